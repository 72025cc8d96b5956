"""Puts vLLM on sys.path for the tests of kvoffload.vllm: $KVOFFLOAD_VLLM_DIR (a folder
holding site/ and pins/, as tools/install_vllm.sh and tools/stage_vllm_bundle.sh leave
them), else the folder of the INSTALLED stamp that Bazel gives the test as data."""

import os
import sys


def _vllm_dir():
    if os.environ.get("KVOFFLOAD_VLLM_DIR"):
        return os.environ["KVOFFLOAD_VLLM_DIR"]
    stamp = os.path.join("third_party", "vllm", "INSTALLED")
    if os.path.exists(stamp):
        return os.path.dirname(os.path.realpath(stamp))
    raise RuntimeError("vLLM is not installed: run tools/install_vllm.sh (or set KVOFFLOAD_VLLM_DIR)")


_dir = _vllm_dir()
for _sub in ("site", "pins"):
    if os.path.join(_dir, _sub) not in sys.path:
        sys.path.append(os.path.join(_dir, _sub))
