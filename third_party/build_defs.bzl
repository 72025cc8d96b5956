"""The macros and rules every kvoffload BUILD file loads."""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")
load("@kvoffload_cuda//:defs.bzl", "CUDA_GENCODE")
load("@kvoffload_python//:defs.bzl", "PYTHON_EXTENSION_SUFFIX")

# The compiler options of kvoffload's C++ and CUDA compiles, set here only (nanobind's
# library keeps the flags its own CMake uses, in nanobind/nanobind.BUILD).
CXX_STANDARD = "c++17"
_OPTIMIZATION = "-O2"

# cc_* targets: copts = COPTS.
COPTS = [
    "-std=" + CXX_STANDARD,
    _OPTIMIZATION,
    "-Wall",
]

# nvcc: the same standard, optimization and warnings, handed to the host compiler too.
_NVCC_COPTS = [
    "-std=" + CXX_STANDARD,
    _OPTIMIZATION,
    "-Xcompiler=-Wall",
]

def _include_flags(compilation_context):
    flags = []
    for d in compilation_context.quote_includes.to_list():
        flags += ["-I", d]
    for d in compilation_context.includes.to_list():
        flags += ["-I", d]
    for d in compilation_context.system_includes.to_list():
        flags += ["-isystem", d]
    for d in compilation_context.defines.to_list():
        flags.append("-D" + d)
    return flags

def _cuda_library_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    features = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    deps_cc = [d[CcInfo] for d in ctx.attr.deps]

    # Repo-relative includes ("cc/...") work also when this repo is an external one.
    root = ctx.label.workspace_root or "."
    own = cc_common.create_compilation_context(
        headers = depset(ctx.files.hdrs),
        quote_includes = depset([root, ctx.bin_dir.path + "/" + root]),
    )
    compilation_context = cc_common.merge_cc_infos(
        cc_infos = [CcInfo(compilation_context = own)] + deps_cc,
    ).compilation_context

    objects = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file("_objs/{}/{}.pic.o".format(ctx.label.name, src.basename))
        args = ctx.actions.args()
        args.add_all(["-x", "cu", "-c", src.path, "-o", obj.path])
        args.add_all(["-ccbin", cc_toolchain.compiler_executable])
        args.add_all(["-Xcompiler", "-fPIC"])
        args.add_all(_NVCC_COPTS)
        args.add_all(CUDA_GENCODE)
        args.add_all(_include_flags(compilation_context))
        args.add_all(ctx.attr.copts)
        ctx.actions.run(
            executable = ctx.file._nvcc,
            arguments = [args],
            inputs = depset(
                [src] + ctx.files._nvcc_files,
                transitive = [compilation_context.headers, cc_toolchain.all_files],
            ),
            outputs = [obj],
            mnemonic = "NvccCompile",
            use_default_shell_env = True,
            progress_message = "Compiling CUDA {}".format(src.short_path),
        )
        objects.append(obj)

    linking_context, _ = cc_common.create_linking_context_from_compilation_outputs(
        actions = ctx.actions,
        feature_configuration = features,
        cc_toolchain = cc_toolchain,
        compilation_outputs = cc_common.create_compilation_outputs(
            pic_objects = depset(objects),
            objects = depset(objects),
        ),
        linking_contexts = [d.linking_context for d in deps_cc],
        name = ctx.label.name,
        # Static only: the static CUDA runtime then resolves in the final link, once.
        disallow_dynamic_library = True,
    )
    return [
        DefaultInfo(files = depset(objects)),
        CcInfo(compilation_context = compilation_context, linking_context = linking_context),
    ]

cuda_library = rule(
    doc = "Compiles .cu files with @kvoffload_cuda's nvcc into a library that cc_* targets depend on.",
    implementation = _cuda_library_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = [".h"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "_nvcc": attr.label(default = "@kvoffload_cuda//:nvcc", allow_single_file = True),
        "_nvcc_files": attr.label(default = "@kvoffload_cuda//:nvcc_files"),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
)

_EXTENSION_LDS = Label("//third_party:python_extension.lds")

def nanobind_extension(name, srcs, deps = [], **kwargs):
    """A Python extension module `name` (e.g. "_C"): a shared library exporting only PyInit_.

    The file is name + ".abi3.so" for Python 3.12+ (stable ABI), else name + the
    interpreter's EXT_SUFFIX (".cpython-311-x86_64-linux-gnu.so"), which no other Python loads;
    the target `name` stands for it either way.
    """
    native.filegroup(name = name, srcs = [name + PYTHON_EXTENSION_SUFFIX])
    native.cc_binary(
        name = name + PYTHON_EXTENSION_SUFFIX,
        srcs = srcs,
        copts = COPTS + ["-fvisibility=hidden", "-fno-strict-aliasing"],
        linkshared = True,
        linkopts = ["-Wl,--version-script=$(location {})".format(_EXTENSION_LDS)],
        additional_linker_inputs = [_EXTENSION_LDS],
        deps = deps + ["@kvoffload_nanobind//:nanobind"],
        **kwargs
    )

def kvoffload_py_test(name, srcs, deps = [], tags = [], size = "small", env = {}, **kwargs):
    """A pytest file run through the shared runner on the configured interpreter."""
    runner = Label("//third_party:pytest_main.py")
    native.py_test(
        name = name,
        srcs = srcs + [runner],
        main = runner,
        args = ["$(location {})".format(s) for s in srcs],
        python_version = "PY3",
        env = dict(env, PYTHONSAFEPATH = "1"),
        # An __init__.py in py/ would make it a package that shadows pytest's `py`.
        legacy_create_init = False,
        size = size,
        tags = tags,
        deps = deps,
        **kwargs
    )

def kvoffload_py_benchmark(name, deps = [], testonly = False):
    """`bazel run //bench:<name>`: the script <name>.py on the configured interpreter.
    testonly when it times a test-only reference (tests/)."""
    native.py_binary(
        name = name,
        srcs = [name + ".py"],
        legacy_create_init = False,
        python_version = "PY3",
        tags = ["benchmark"],
        testonly = testonly,
        deps = deps + [Label("//py/kvoffload")],
    )

def kvoffload_gpu_test(name, srcs, gpus = 1, **kwargs):
    """A kvoffload_py_test that needs a GPU, tagged gpu (bazel test --config=gpu), or
    two, tagged gpu and multi_gpu (bazel test --config=multi_gpu)."""
    tags = ["gpu"] + (["multi_gpu"] if gpus > 1 else [])
    kvoffload_py_test(name = name, srcs = srcs, size = "medium", tags = tags, **kwargs)
