"""Puts vLLM on sys.path for the tests and benchmark of kvoffload.vllm: $KVOFFLOAD_VLLM_DIR
(a folder holding site/ and pins/, as tools/install_vllm.sh and tools/stage_vllm_bundle.sh
leave them), else the folder of the INSTALLED stamp beside this file (Bazel's data), else
vllm_light/ beside this file (the unpacked bundle). LIGHT: only vLLM's offloading modules
are there, not its config and connector."""

import importlib
import os
import sys
import types


def _vllm_dir():
    if os.environ.get("KVOFFLOAD_VLLM_DIR"):
        return os.environ["KVOFFLOAD_VLLM_DIR"]
    stamp = os.path.join(os.path.dirname(os.path.abspath(__file__)), "INSTALLED")
    if os.path.exists(stamp):
        return os.path.dirname(os.path.realpath(stamp))
    light = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_light")
    if os.path.isdir(light):
        return light
    raise RuntimeError("vLLM is not installed: run tools/install_vllm.sh (or set KVOFFLOAD_VLLM_DIR)")


_dir = _vllm_dir()
LIGHT = os.path.exists(os.path.join(_dir, "LIGHT"))
for _sub in ("pins", "site"):
    if os.path.join(_dir, _sub) not in sys.path:
        sys.path.insert(0, os.path.join(_dir, _sub))
# vLLM needs a newer typing_extensions than the one pytest's plugins may have loaded.
_loaded = sys.modules.get("typing_extensions")
if _loaded is not None and not _loaded.__file__.startswith(_dir):
    del sys.modules["typing_extensions"]
    importlib.import_module("typing_extensions")
# The light bundle has none of vLLM's compiled modules; vllm.platforms.cuda imports these
# only to register ops, which kvoffload's tests and benchmarks do not call.
if LIGHT:
    for _name in ("vllm._C", "vllm._C_stable_libtorch", "vllm._moe_C", "vllm._flashmla_C"):
        sys.modules.setdefault(_name, types.ModuleType(_name))
