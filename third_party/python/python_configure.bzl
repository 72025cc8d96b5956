"""Finds the local Python (the TensorFlow *_configure pattern).

Interpreter: $PYTHON_BIN_PATH (a path, or a name looked up on PATH), else python3.
Python 3.12+ builds the stable-ABI extension (_C.abi3.so, wheel tag cp312-abi3); older
ones an extension for that version only (_C.cpython-311-....so, tag cp311-cp311).
"""

load("//third_party/pip:pip_wheel.bzl", "find_python")

_PROBE = """
import json, sys, sysconfig
print(json.dumps({
    "executable": sys.executable,
    "version": list(sys.version_info[:2]),
    "include": sysconfig.get_paths()["include"],
    "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
}))
"""

_STABLE_ABI_MIN = [3, 12]
_STABLE_ABI_TAG = "cp312-abi3"

def _fail(msg):
    fail("kvoffload python_configure: " + msg)

def _python_configure_impl(ctx):
    interpreter = find_python(ctx)
    result = ctx.execute([interpreter, "-c", _PROBE])
    if result.return_code != 0:
        _fail("running {} failed: {}".format(interpreter, result.stderr))
    info = json.decode(result.stdout.strip())
    stable_abi = info["version"] >= _STABLE_ABI_MIN
    if stable_abi:
        extension_suffix, wheel_tag = ".abi3.so", _STABLE_ABI_TAG
    else:
        cp = "cp{}{}".format(*info["version"])
        extension_suffix, wheel_tag = info["ext_suffix"], cp + "-" + cp
    ctx.symlink(info["include"], "include")
    ctx.template("BUILD.bazel", ctx.attr._build_tpl, {
        "%{interpreter}": info["executable"],
        "%{python_version}": "PY3",
        "%{stable_abi_defines}": '"Py_LIMITED_API=0x030C0000"' if stable_abi else "",
    })
    ctx.file("defs.bzl", "\n".join([
        '"""What the local Python toolchain was configured with."""',
        "PYTHON_VERSION = {}".format(repr("{}.{}".format(*info["version"]))),
        "PYTHON_EXTENSION_SUFFIX = {}".format(repr(extension_suffix)),
        "PYTHON_WHEEL_TAG = {}".format(repr(wheel_tag)),
        "",
    ]))

python_configure = repository_rule(
    implementation = _python_configure_impl,
    environ = ["PYTHON_BIN_PATH", "PATH"],
    local = True,
    attrs = {
        "_build_tpl": attr.label(default = Label("//third_party/python:BUILD.tpl")),
    },
)
