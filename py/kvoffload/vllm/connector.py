"""``KVOffloadConnector``: vLLM's OffloadingConnector asking vLLM for the KV-cache layout
kvoffload moves fastest, block-outermost (``BLHNC``), where each block is one run across
all layers and moves as one copy.

vLLM resolves the layout once per engine (``resolve_kv_cache_layout``, 0.32 and 0.33):
``VLLM_KV_CACHE_LAYOUT`` wins where set; else a connector's layout is taken where every
attention backend of the model supports it, and dropped with a warning otherwise (vLLM's
CPU backend takes only ``LBHNC``). So, unlike the environment variable, which stops an
engine whose backends lack the layout, this connector falls back to the backends' own
first choice and the engine runs. Select it with
``KVTransferConfig(kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.vllm",
kv_connector_extra_config={...})``, the extra config as for OffloadingConnector
(``spec_name``, ``spec_module_path``, ...).

Not for: ``canonical_layout=True``, whose per-layer pages vLLM refuses on a packed cache
(it then asks for what OffloadingConnector asks for); nor inside vLLM's MultiConnector
beside a connector that asks for another layout (NIXL and Mooncake ask for LBHNC), which
stops the engine with a layout mismatch, and which looks connectors up by registered
name, which this one has not.
"""

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

# The layout asked for: a block's pages of every layer back to back (docs/vllm.md#layouts).
LAYOUT = "BLHNC"


class KVOffloadConnector(OffloadingConnector):
    """OffloadingConnector, asking for LAYOUT."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        transfer = vllm_config.kv_transfer_config
        if (getattr(transfer, "kv_connector_extra_config", None) or {}).get("canonical_layout"):
            return super().get_required_kvcache_layout(vllm_config)
        return LAYOUT
