"""vLLM's tiering (a CPU primary tier and secondary tiers: ``fs``, ``obj``, ``p2p``) with
kvoffload's GPU<->CPU worker in place of vLLM's ``CPUOffloadingWorker``.

``KVOffloadTieringSpec`` keeps vLLM's ``TieringOffloadingSpec``, its manager and its tiers
as they are, and overrides only ``create_worker``: the worker is kvoffload's
``KVOffloadRegionWorker`` (kvoffload.vllm.region_worker) on the spec's
``SharedOffloadRegion``.

Select it with ``kv_connector_extra_config={"spec_name": "KVOffloadTieringSpec",
"spec_module_path": "kvoffload.vllm", "cpu_bytes_to_use": N, "secondary_tiers":
[{"type": "fs", "root_dir": "/path"}]}``; the ``kvoffload_*`` keys of KVOffloadSpec
apply, but for ``kvoffload_cpu_layout``: the layout is the region's.
"""
from __future__ import annotations

import errno
import os
import stat
import time

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from ..pool.shm_file import planted
from .region_worker import KVOffloadRegionWorker
from .spec import handler_options, require_chunks


class KVOffloadTieringSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec (its TieringOffloadingManager, CPU primary tier and
    secondary tiers unchanged), with KVOffloadRegionWorker moving blocks between the GPU
    and the CPU primary tier's SharedOffloadRegion."""

    def create_worker(self, kv_caches) -> KVOffloadRegionWorker:
        # What TieringOffloadingSpec.create_worker does, with kvoffload's worker.
        require_chunks(self)
        canonical = bool(self.config.canonical_layout)
        if canonical and self.blocks_per_chunk != 1:
            raise ValueError(
                f"kv_connector_extra_config: canonical_layout=True needs one GPU block per offloaded "
                f"block; block_size={self.extra_config.get('block_size')!r} makes blocks_per_chunk="
                f"{self.blocks_per_chunk}")
        options = handler_options(self.extra_config)
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        _refuse_planted(f"/dev/shm/vllm_offload_{self._engine_id}.mmap",  # as SharedOffloadRegion names it
                        self.num_chunks * self.kv_bytes_per_chunk)
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            _require_private(region)
            if canonical:
                self._validate_canonical_refs(kv_caches)  # vLLM's: every ref has a mapping
            return KVOffloadRegionWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region,
                                         canonical_layout=canonical, **options)
        except Exception:
            region.cleanup()
            raise

    def get_worker(self, kv_caches) -> KVOffloadRegionWorker:
        # Not CPUOffloadingSpec.get_worker: it refuses a machine without CUDA, where
        # kvoffload's handler runs its jobs on host threads.
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker


_LINKED = "is a symbolic link or a second link to a file"


def _refusal(path: str, why: str) -> PermissionError:
    return PermissionError(errno.EPERM, f"{path} {why}; refusing vLLM's shared region, which another "
                                        "user could have planted or another engine may use (remove it, "
                                        "or give the engine an unguessable kv_transfer_config engine_id)", path)


# A region's creator sizes its file right after making it: one that stays smaller than
# the region this long after it was made or changed is a crashed engine's leftover.
STALE_SECONDS = 5.0


def _refuse_planted(path: str, region_bytes: int) -> None:
    """Before vLLM opens it: a planted file, or a smaller one a crashed engine left, would
    hold vLLM's join for its 30 s timeout, and a FIFO or directory fail it with errors
    that name no cause."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    linked = stat.S_ISLNK(found.st_mode) or found.st_nlink != 1
    why = _LINKED if linked else planted(found)
    if why is not None:
        raise _refusal(path, why)
    # From its last change, and never longer than that from now (a ctime in the future).
    deadline = min(found.st_ctime, time.time()) + STALE_SECONDS
    while found.st_size < region_bytes and time.time() < deadline:
        time.sleep(0.01)  # its creator may be sizing it now
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            return
    if found.st_size < region_bytes:
        raise _refusal(path, f"holds {found.st_size} bytes, fewer than the {region_bytes} of this engine's "
                              f"region, and has not grown for {STALE_SECONDS:g} s (a crashed engine's leftover)")


def _require_private(region: SharedOffloadRegion) -> None:
    """vLLM's region joins a file already under its name as it finds it: one that another
    user planted there (an engine id is no secret) would share the KV cache with them, and
    one of another engine under the same id would mix their KV caches."""
    opened = os.fstat(region.fd)
    # vLLM maps a region of several segments from files it opens by name: each must be one.
    for path, offset, length in getattr(region, "_segments", [(region.mmap_path, 0, region.total_size_bytes)]):
        try:
            named = os.lstat(path)
        except FileNotFoundError:
            named = None
        held = named if named is not None and offset else opened
        why = planted(held)
        if why is None and (named is None or named.st_nlink != 1 or offset == 0 and (
                named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino)):
            why = f"{_LINKED}, or no longer the file opened"
        if why is None and held.st_size != length:
            why = f"holds {held.st_size} bytes, not the {length} of this engine's region"
        if why is not None:
            raise _refusal(path, why)
