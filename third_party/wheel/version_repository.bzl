"""@kvoffload_version: the package's version, read from the one line that defines it.

py/kvoffload/__init__.py holds `__version__ = "X.Y.Z"`; the wheel's file name needs the
version when Bazel loads BUILD files, so this repository copies it into defs.bzl. Bazel
reads the file again whenever it changes.
"""

_PREFIX = "__version__ = "

def _version_repository_impl(ctx):
    lines = [l for l in ctx.read(ctx.attr.version_file).splitlines() if l.startswith(_PREFIX)]
    if len(lines) != 1:
        fail("kvoffload version_repository: {} needs exactly one line `{}\"X.Y.Z\"`, found {}".format(
            ctx.attr.version_file,
            _PREFIX,
            len(lines),
        ))
    version = lines[0][len(_PREFIX):].strip()
    if len(version) < 3 or version[0] != '"' or version[-1] != '"':
        fail("kvoffload version_repository: {} must be a double-quoted string, got {}".format(
            _PREFIX.strip(" ="),
            version,
        ))
    ctx.file("BUILD.bazel", "")
    ctx.file("defs.bzl", "VERSION = {}\n".format(version))

version_repository = repository_rule(
    implementation = _version_repository_impl,
    attrs = {
        "version_file": attr.label(mandatory = True, allow_single_file = True),
    },
)
