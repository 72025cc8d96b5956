"""kvoffload behind vLLM's KV offloading connector.

``KVOffloadWorker`` (kvoffload.vllm.worker) needs only vLLM's light offloading modules;
``KVOffloadSpec`` (kvoffload.vllm.spec) pulls in vLLM's config and scheduler side, so it
is imported on first use. Select it with
``kv_connector_extra_config={"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm",
"cpu_bytes_to_use": N}``; with ``kv_connector="KVOffloadConnector",
kv_connector_module_path="kvoffload.vllm"`` vLLM is also asked for the layout kvoffload
moves fastest (kvoffload.vllm.connector).
"""

import os as _os
import re as _re

import vllm as _vllm

# The vLLM minor versions kvoffload.vllm is tested with: 0.32 end to end (vLLM's CPU build,
# tests/vllm/vllm_engine_test.py), 0.33 through its classes (tests/vllm/vllm_*_test.py).
SUPPORTED_VLLM = ("0.32", "0.33")


def _check_vllm_version(version) -> None:
    """ImportError unless vLLM is a release (pre-, post- or dev release included) of a
    minor version in SUPPORTED_VLLM; KVOFFLOAD_VLLM_UNCHECKED=1 skips the check."""
    if _os.environ.get("KVOFFLOAD_VLLM_UNCHECKED") == "1":
        return
    found = _re.match(r"(\d+)\.(\d+)(?:[.+a-z]|$)", str(version))
    if found is None or f"{found[1]}.{found[2]}" not in SUPPORTED_VLLM:
        raise ImportError(
            f"kvoffload.vllm: found vLLM {version}, which it does not support; it supports vLLM "
            f"{' and '.join(v + '.x' for v in SUPPORTED_VLLM)}. Install one of those, or set "
            "KVOFFLOAD_VLLM_UNCHECKED=1 to try this one anyway.")


_check_vllm_version(getattr(_vllm, "__version__", "unknown"))

from .worker import KVOffloadWorker  # noqa: E402 - after the version check

__all__ = ["KVOffloadConnector", "KVOffloadSpec", "KVOffloadWorker"]


def __getattr__(name):
    if name == "KVOffloadSpec":
        from .spec import KVOffloadSpec

        return KVOffloadSpec
    if name == "KVOffloadTieringSpec":  # vLLM's tiering on kvoffload's worker (kvoffload.vllm.tiering)
        return __import__("kvoffload.vllm.tiering", fromlist=[name]).KVOffloadTieringSpec
    if name == "KVOffloadConnector":  # asks vLLM for the BLHNC layout (kvoffload.vllm.connector)
        return __import__("kvoffload.vllm.connector", fromlist=[name]).KVOffloadConnector
    if name == "KVOffloadRegionWorker":  # on vLLM's SharedOffloadRegion (kvoffload.vllm.region_worker)
        return __import__("kvoffload.vllm.region_worker", fromlist=[name]).KVOffloadRegionWorker
    raise AttributeError(f"module 'kvoffload.vllm' has no attribute {name!r}")
