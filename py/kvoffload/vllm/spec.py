"""The OffloadingSpec that selects KVOffloadWorker: vLLM's CPU offloading spec, whose
scheduler-side manager and pool sizing (``cpu_bytes_to_use``) it keeps, with kvoffload's
worker in place of vLLM's."""

from __future__ import annotations

import logging
import re

from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ..costs.auto import Auto
from ..jobs.methods import method_object
from ..pages.paths import Pages
from ..pool.host_pool import PoolOptions
from ..pool.layout import CPU_LAYOUTS
from ..pool.shm_file import SHM_DIR, TEMPORARY_PREFIX, remove_leftovers, unguessable_name
from .worker import KVOffloadWorker

# kv_connector_extra_config keys read here; anything else goes to vLLM's spec.
HANDLER_OPTIONS = {"kvoffload_method": "method", "kvoffload_cpu_layout": "cpu_layout"}
MAX_SLOWDOWN = "kvoffload_max_slowdown"  # with "kvoffload_method" "pages" (the default) or "auto"
SHARED_POOL_PREFIX = "kvoffload-vllm-"  # shared_pool_name's

logger = logging.getLogger(__name__)


def handler_options(extra_config) -> dict:
    """OffloadHandler's keyword arguments from vLLM's kv_connector_extra_config. A
    kvoffload_ key that names none is refused: vLLM would drop it without a word."""
    known = (*HANDLER_OPTIONS, MAX_SLOWDOWN)
    for key in extra_config:
        if isinstance(key, str) and key.startswith("kvoffload_") and key not in known:
            raise ValueError(f"kv_connector_extra_config: {key!r} is no kvoffload option; "
                             f"expected one of {list(known)}")
    options = {}
    for key, option in HANDLER_OPTIONS.items():
        if key not in extra_config:
            continue
        value = options[option] = extra_config[key]
        try:
            if option == "method":
                method_object(value)
            elif value is not None and value not in CPU_LAYOUTS:
                raise ValueError(f"expected one of {list(CPU_LAYOUTS)}, got {value!r}")
        except (TypeError, ValueError) as e:
            raise type(e)(f"kv_connector_extra_config: {key}: {e}") from None
    if MAX_SLOWDOWN in extra_config:
        method = options.get("method", "pages")
        if method not in ("pages", "auto"):
            raise ValueError(f"kv_connector_extra_config: {MAX_SLOWDOWN} is an option of "
                             f"\"kvoffload_method\": \"pages\" or \"auto\", got method {method!r}")
        try:
            options["method"] = (Auto if method == "auto" else Pages)(max_slowdown=extra_config[MAX_SLOWDOWN])
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config: {MAX_SLOWDOWN}: {e}") from None
    return options


def require_chunks(spec) -> None:
    """Refuses a cpu_bytes_to_use that holds no chunk, naming it (vLLM's spec computes
    num_chunks from it)."""
    if spec.num_chunks <= 0:
        raise ValueError(
            f"kv_connector_extra_config: cpu_bytes_to_use={spec.extra_config.get('cpu_bytes_to_use')!r} "
            f"holds no chunk of {spec.kv_bytes_per_chunk} bytes (OffloadingConfig."
            f"worker_kv_bytes_per_block={spec.config.worker_kv_bytes_per_block}, "
            f"blocks_per_chunk={spec.blocks_per_chunk})")


def shared_pool_name(engine_id) -> str:
    """The start of the /dev/shm file that the ranks of one engine share under vLLM's
    replicated layout; rank 0 adds a secret suffix (unguessable_name) that it gives the
    others, so no other user can plant the file beforehand."""
    return SHARED_POOL_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id))[:200]


class KVOffloadSpec(CPUOffloadingSpec):
    """Each worker process keeps a private pool, except under vLLM's replicated layout
    (MLA under tensor parallelism, where every rank holds the same KV): the ranks then
    share one pool, a file under /dev/shm named after the engine (``shared_pool_name``)
    and a secret rank 0 shares with the others,
    rank 0 stores into it (vLLM's connector skips the others' stores), every rank loads
    from it, and ``cpu_bytes_to_use`` holds one copy."""

    def __init__(self, config):
        if config.canonical_layout:
            raise ValueError("kv_connector_extra_config: canonical_layout=True: vLLM keeps canonical "
                             "pages only in its tiering spec's region; use \"spec_name\": "
                             "\"KVOffloadTieringSpec\"")
        super().__init__(config)

    def _uses_shared_region(self) -> bool:
        return True  # a HostPool can be one file shared by the ranks

    def create_worker(self, kv_caches) -> KVOffloadWorker:
        require_chunks(self)
        options = handler_options(self.extra_config)
        if not self.replicated_layout:
            return KVOffloadWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, **options)
        if self.config.parallel.rank == 0:
            # An engine killed before its ranks had all mapped the pool left its file
            # named: no later engine takes that name again (its secret), so remove it here.
            try:
                for left in remove_leftovers(SHARED_POOL_PREFIX) + remove_leftovers(TEMPORARY_PREFIX):
                    logger.warning("kvoffload: removed %s/%s, a shared pool file a killed engine left",
                                   SHM_DIR, left)
            except OSError as e:  # best effort: the other ranks wait for this one's name
                logger.warning("kvoffload: could not look for shared pool files killed engines left: %s", e)
        name = unguessable_name(shared_pool_name(self.config.engine_id), share=self._share_pool_name)
        options["host_pool"] = PoolOptions(shm_name=name)
        try:
            worker = KVOffloadWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, **options)
        except BaseException as failure:
            # The other ranks wait for this one at the barrier: release them, so they go on
            # to fail on their own rather than wait out the barrier's timeout.
            try:
                self._ranks_attached()
            except BaseException as e:  # noqa: BLE001 - the worker's failure is the one to raise
                logger.warning("kvoffload: the barrier after this rank's failure failed too: %s", e)
            raise failure
        try:
            # Once every rank has mapped it, the file needs no name: an engine that is
            # killed then leaves nothing in /dev/shm (vLLM unlinks its region so too).
            self._ranks_attached()
            if self.config.parallel.rank == 0:
                worker.handler.pool.memory.shared_file.unlink()
        except BaseException:
            worker.shutdown()
            raise
        return worker

    def _share_pool_name(self, name: str) -> str:
        """Rank 0's name, to every rank: vLLM takes the replicated layout only with tensor
        parallelism on one node, so the ranks that share the pool are the TP group."""
        from vllm.distributed.parallel_state import get_tp_group
        return get_tp_group().broadcast_object(name, src=0)

    def _ranks_attached(self) -> None:
        """Returns once every rank of the TP group has mapped the shared pool."""
        from vllm.distributed.parallel_state import get_tp_group
        get_tp_group().barrier()

    def get_worker(self, kv_caches) -> KVOffloadWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker
