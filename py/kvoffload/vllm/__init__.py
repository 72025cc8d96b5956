"""kvoffload behind vLLM's KV offloading connector.

``KVOffloadWorker`` (kvoffload.vllm.worker) needs only vLLM's light offloading modules;
``KVOffloadSpec`` (kvoffload.vllm.spec) pulls in vLLM's config and scheduler side, so it
is imported on first use. Select it with
``kv_connector_extra_config={"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm",
"cpu_bytes_to_use": N}``.
"""

from kvoffload.vllm.worker import KVOffloadWorker

__all__ = ["KVOffloadSpec", "KVOffloadWorker"]


def __getattr__(name):
    if name == "KVOffloadSpec":
        from kvoffload.vllm.spec import KVOffloadSpec

        return KVOffloadSpec
    raise AttributeError(f"module 'kvoffload.vllm' has no attribute {name!r}")
