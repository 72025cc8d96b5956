"""kvoffload_wheel: a binary wheel of one Python package and its extension modules.

The file is <distribution>-<version>-<python tag>-<platform>.whl: the version comes from
the package's `__version__`, the Python tag from the configured interpreter
(cp312-abi3 for 3.12+, else e.g. cp311-cp311).
"""

load("@kvoffload_python//:defs.bzl", "PYTHON_WHEEL_TAG")
load("@kvoffload_version//:defs.bzl", "VERSION")

_PY_TOOLCHAIN = "@bazel_tools//tools/python:toolchain_type"

def _package_files(package):
    """The files of `package`'s runfiles that live in its own directory (modules, extensions)."""
    prefix = package.label.package + "/"
    files = [
        f
        for f in package[DefaultInfo].default_runfiles.files.to_list()
        if f.short_path.startswith(prefix)
    ]
    return prefix, files

def _kvoffload_wheel_impl(ctx):
    wheel = ctx.actions.declare_file("{}-{}-{}-{}.whl".format(
        ctx.attr.distribution,
        VERSION,
        PYTHON_WHEEL_TAG,
        ctx.attr.platform,
    ))
    prefix, files = _package_files(ctx.attr.package)
    import_name = ctx.attr.package.label.package.split("/")[-1]

    args = ctx.actions.args()
    args.add(ctx.file._builder)
    args.add("--out", wheel)
    args.add("--distribution", ctx.attr.distribution)
    args.add("--version", VERSION)
    args.add("--tag", PYTHON_WHEEL_TAG + "-" + ctx.attr.platform)
    args.add("--summary", ctx.attr.summary)
    args.add("--license", ctx.attr.license)
    args.add("--requires-python", ctx.attr.requires_python)
    args.add("--description", ctx.file.description)
    args.add_all(ctx.attr.requires, before_each = "--requires")
    for extra, requirements in sorted(ctx.attr.extras.items()):
        args.add_all(requirements, before_each = "--extra", format_each = extra + ":%s")
    for f in files:
        args.add("--file", "{}/{}={}".format(import_name, f.short_path[len(prefix):], f.path))

    ctx.actions.run(
        executable = ctx.toolchains[_PY_TOOLCHAIN].py3_runtime.interpreter_path,
        arguments = [args],
        inputs = files + [ctx.file._builder, ctx.file.description],
        outputs = [wheel],
        mnemonic = "PythonWheel",
        progress_message = "Building wheel {}".format(wheel.basename),
    )
    return [DefaultInfo(files = depset([wheel]), runfiles = ctx.runfiles(files = [wheel]))]

kvoffload_wheel = rule(
    doc = "A wheel holding one py_library's package directory (modules and extensions).",
    implementation = _kvoffload_wheel_impl,
    attrs = {
        "package": attr.label(mandatory = True, doc = "the py_library whose directory is the package"),
        "distribution": attr.string(mandatory = True),
        "platform": attr.string(mandatory = True, doc = "e.g. manylinux_2_34_x86_64; a test checks it"),
        "summary": attr.string(mandatory = True),
        "license": attr.string(mandatory = True),
        "requires_python": attr.string(mandatory = True),
        "description": attr.label(mandatory = True, allow_single_file = [".md"]),
        "requires": attr.string_list(doc = "Requires-Dist lines"),
        "extras": attr.string_list_dict(doc = "extra name -> its requirements"),
        "_builder": attr.label(default = Label("//third_party/wheel:build_wheel.py"), allow_single_file = True),
    },
    toolchains = [_PY_TOOLCHAIN],
)
