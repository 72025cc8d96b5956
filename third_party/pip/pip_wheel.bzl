"""Fetches a pinned wheel with pip, checks its sha256 and unpacks it, inside a repository rule.

pip finds the package by name and version in the registry it is configured for; the wheel's
sha256, committed beside the pin, decides whether it is the file that was pinned.
"""

_HASH = "import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())"

def find_python(ctx):
    """The interpreter the build uses: $PYTHON_BIN_PATH (a path or a name on PATH), else python3."""
    name = ctx.os.environ.get("PYTHON_BIN_PATH", "python3")
    if "/" in name:
        path = ctx.path(name)
        if not path.exists:
            fail("kvoffload: PYTHON_BIN_PATH={} does not exist".format(name))
        return path
    path = ctx.which(name)
    if path == None:
        fail("kvoffload: no '{}' on PATH; install Python 3 or set PYTHON_BIN_PATH".format(name))
    return path

def _normalized(package):
    return package.replace("-", "_").lower()

def fetch_wheel(ctx, python, package, version, sha256, output, strip_prefix = ""):
    """Downloads package==version with pip, fails unless its sha256 matches, unpacks it."""
    pin = "{}=={} (expected sha256 {})".format(package, version, sha256)
    dest = "_pip_download"
    result = ctx.execute([
        python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
        "--no-deps", "--only-binary=:all:", "--dest", dest, "{}=={}".format(package, version),
    ], timeout = 900)
    if result.return_code != 0:
        fail("pip could not download {}:\n{}".format(pin, result.stderr))
    prefix = "{}-{}-".format(_normalized(package), version)
    wheels = [
        f
        for f in ctx.path(dest).readdir()
        if f.basename.lower().startswith(prefix) and f.basename.endswith(".whl")
    ]
    if len(wheels) != 1:
        fail("pip download of {} left {} wheels in {}".format(pin, len(wheels), dest))
    got = ctx.execute([python, "-c", _HASH, str(wheels[0])]).stdout.strip()
    if got != sha256:
        fail("checksum mismatch for {}: {} has sha256 {}".format(pin, wheels[0].basename, got))

    # A wheel is a zip archive; extract() knows it by that suffix.
    archive = dest + "/wheel.zip"
    ctx.symlink(wheels[0], archive)
    ctx.extract(archive, output = output, stripPrefix = strip_prefix)
    ctx.delete(dest)

def _pip_wheel_repository_impl(ctx):
    fetch_wheel(ctx, find_python(ctx), ctx.attr.package, ctx.attr.version, ctx.attr.sha256,
                output = ".", strip_prefix = ctx.attr.strip_prefix)
    ctx.symlink(ctx.attr.build_file, "BUILD.bazel")

pip_wheel_repository = repository_rule(
    doc = "A repository holding one pinned wheel's files, with the given BUILD file.",
    implementation = _pip_wheel_repository_impl,
    attrs = {
        "package": attr.string(mandatory = True),
        "version": attr.string(mandatory = True),
        "sha256": attr.string(mandatory = True),
        "strip_prefix": attr.string(),
        "build_file": attr.label(mandatory = True, allow_single_file = True),
    },
)
