"""The OffloadingSpec that selects KVOffloadWorker: vLLM's CPU offloading spec, whose
scheduler-side manager and pool sizing (``cpu_bytes_to_use``) it keeps, with kvoffload's
worker in place of vLLM's."""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvoffload.vllm.worker import KVOffloadWorker

logger = logging.getLogger(__name__)

# kv_connector_extra_config keys read here; anything else goes to vLLM's spec.
HANDLER_OPTIONS = {"kvoffload_method": "method", "kvoffload_max_slowdown": "max_slowdown",
                   "kvoffload_cpu_layout": "cpu_layout"}


class KVOffloadSpec(CPUOffloadingSpec):
    """Each worker process keeps a private pool: vLLM's replicated layout (one rank
    storing for every rank into a shared region, MLA under tensor parallelism) is never
    taken, so every rank stores its own copy and ``cpu_bytes_to_use`` covers them all."""

    def __init__(self, config):
        if config.canonical_layout:
            raise ValueError("kv_connector_extra_config: canonical_layout=True is not supported "
                             "by kvoffload.vllm's worker; leave it unset")
        super().__init__(config)
        if config.replicated_layout:
            logger.info("kvoffload.vllm: replicated_layout turned off: each of %d ranks stores "
                        "its own copy in a private pool", config.parallel.world_size)

    def _uses_shared_region(self) -> bool:
        return False

    def create_worker(self, kv_caches) -> KVOffloadWorker:
        options = {}
        for key, option in HANDLER_OPTIONS.items():
            if key in self.extra_config:
                options[option] = self.extra_config[key]
        return KVOffloadWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, **options)

    def get_worker(self, kv_caches) -> KVOffloadWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker
