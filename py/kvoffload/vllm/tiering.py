"""vLLM's tiering (a CPU primary tier and secondary tiers: ``fs``, ``obj``, ``p2p``) with
kvoffload's GPU<->CPU worker in place of vLLM's ``CPUOffloadingWorker``.

vLLM 0.33's ``TieringOffloadingSpec`` keeps its CPU chunks in a ``SharedOffloadRegion``
(an mmap of /dev/shm/vllm_offload_<engine_id>.mmap): the scheduler side maps it whole
and its secondary tiers read and write chunk c as row c of that mapping
(``create_kv_memoryview()``); each worker maps it again and moves blocks through one
view per KV-cache tensor (``create_next_worker_view``). ``KVOffloadTieringSpec`` keeps
the spec, its manager and its tiers as they are, and overrides only ``create_worker``
(where vLLM builds ``CPUOffloadingWorker(mmap_region=...)``): kvoffload's handler gets
the worker's region as its pool, so the bytes a store writes are the bytes the tiers
read, and a chunk a tier promotes is what a load reads.

Select it with ``kv_connector_extra_config={"spec_name": "KVOffloadTieringSpec",
"spec_module_path": "kvoffload.vllm", "cpu_bytes_to_use": N, "secondary_tiers":
[{"type": "fs", "root_dir": "/path"}]}``; the ``kvoffload_*`` keys of KVOffloadSpec
apply.

The handler takes one contiguous pool in one of its layouts (kvoffload.host_pool), so
the region must lay its views out as that pool would: every tensor of the cache in one
row per chunk, in ``kv_caches.tensors`` order, each holding ``blocks_per_chunk`` whole
pages (``page_size_bytes`` of every reference equal to its tensor's when a chunk holds
more than one block), and no padding at the row's end. That is one engine rank (or
vLLM's replicated layout) with a row a multiple of the 4 KiB page. Other caches are
refused, before anything is mapped into the handler, with the vLLM field that differs.
"""

from __future__ import annotations

from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvoffload.host_pool import CPU_LAYOUTS, cpu_tensor_layouts, pool_bytes, tensor_owners
from kvoffload.vllm.spec import HANDLER_OPTIONS
from kvoffload.vllm.worker import KVOffloadWorker, _block_view, group_tensors


class KVOffloadRegionWorker(KVOffloadWorker):
    """KVOffloadWorker whose pool is ``region``'s memory: one worker view per tensor of
    ``kv_caches`` (as vLLM's CPUOffloadingWorker takes them), handed to the handler as
    its ``host_buffer`` in the layout that puts every page where vLLM's view has it.
    Owns ``region`` once constructed: ``shutdown()`` releases it after the handler."""

    def __init__(self, kv_caches, blocks_per_chunk: int, num_cpu_chunks: int,
                 region: SharedOffloadRegion, **handler_options):
        for key in ("host_buffer", "host_pool"):
            if key in handler_options:
                raise ValueError(f"{key}: the pool is vLLM's SharedOffloadRegion; it cannot be given")
        self.region = self.region_views = None
        layout, start, nbytes, views = _region_pool(kv_caches, blocks_per_chunk, num_cpu_chunks, region)
        wanted = handler_options.pop("cpu_layout", layout)
        if wanted != layout:
            views.clear()
            raise ValueError(f"kv_connector_extra_config: kvoffload_cpu_layout={wanted!r} does not "
                             f"match vLLM's SharedOffloadRegion, which this cache lays out as {layout!r}; "
                             "leave it unset")
        self.region, self.region_views = region, views
        try:
            super().__init__(kv_caches, blocks_per_chunk, num_cpu_chunks, cpu_layout=layout,
                             host_buffer=region.base_tensor[start:start + nbytes], **handler_options)
        except BaseException:
            self.region_views = views = None  # so that the caller's region.cleanup() can unmap it
            raise
        try:
            _check_handler(self.handler.layout, kv_caches, views)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Waits for every job, releases the handler, then the region (vLLM's mapping of
        it, and the file if this worker made it)."""
        try:
            super().shutdown()
        finally:
            region, self.region = self.region, None
            if region is not None:
                # Views of the region left alive keep it mapped (vLLM's cleanup then only
                # warns): the handler's watch of its host_buffer, and ours.
                try:
                    self.handler.registry.unregister("host_buffer")
                except (AttributeError, KeyError):
                    pass
                self.region_views = None
                region.cleanup()


class KVOffloadTieringSpec(TieringOffloadingSpec):
    """vLLM's TieringOffloadingSpec (its TieringOffloadingManager, CPU primary tier and
    secondary tiers unchanged), with KVOffloadRegionWorker moving blocks between the GPU
    and the CPU primary tier's SharedOffloadRegion."""

    def __init__(self, config):
        if config.canonical_layout:
            raise ValueError("kv_connector_extra_config: canonical_layout=True is not supported "
                             "by kvoffload.vllm's worker; leave it unset")
        super().__init__(config)

    def create_worker(self, kv_caches) -> KVOffloadRegionWorker:
        # What TieringOffloadingSpec.create_worker does, with kvoffload's worker.
        if self.num_chunks <= 0:
            raise ValueError(
                f"kv_connector_extra_config: cpu_bytes_to_use={self.extra_config.get('cpu_bytes_to_use')!r} "
                f"holds no chunk of {self.kv_bytes_per_chunk} bytes (OffloadingConfig."
                f"worker_kv_bytes_per_block={self.config.worker_kv_bytes_per_block}, "
                f"blocks_per_chunk={self.blocks_per_chunk})")
        options = {option: self.extra_config[key] for key, option in HANDLER_OPTIONS.items()
                   if key in self.extra_config}
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return KVOffloadRegionWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region, **options)
        except Exception:
            region.cleanup()
            raise

    def get_worker(self, kv_caches) -> KVOffloadRegionWorker:
        # Not CPUOffloadingSpec.get_worker: it refuses a machine without CUDA, where
        # kvoffload's handler runs its jobs on host threads.
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker


def _region_pool(kv_caches, blocks_per_chunk, num_chunks, region):
    """(cpu_layout, byte offset of the pool in the region, pool bytes, the region's
    worker views, one per tensor) for a cache whose pages kvoffload's pool puts exactly
    where the region's views have them; ValueError naming the field otherwise."""
    tensors = list(getattr(kv_caches, "tensors", None) or ())
    if not tensors:
        raise ValueError("kv_caches.tensors: no tensors to offload")
    gpu = [_block_view(t, f"kv_caches.tensors[{i}]") for i, t in enumerate(tensors)]
    slot = _slot_bytes(region)
    need = blocks_per_chunk * sum(t.page_size_bytes for t in tensors)
    if need > slot:
        raise ValueError(
            f"kv_caches.tensors: {len(tensors)} tensors of page_size_bytes "
            f"{[t.page_size_bytes for t in tensors]} need {need} bytes per chunk "
            f"(blocks_per_chunk={blocks_per_chunk}), more than the {slot} of vLLM's region slot "
            "(OffloadingConfig.worker_kv_bytes_per_block * blocks_per_chunk)")
    # The views vLLM's CPUOffloadingWorker takes, in its order.
    views = [region.create_next_worker_view(blocks_per_chunk * t.page_size_bytes) for t in tensors]
    try:
        return _check_pool(kv_caches, blocks_per_chunk, num_chunks, region, tensors, gpu, views, need)
    except BaseException:
        views.clear()  # the traceback keeps this frame: no view of the region may stay in it
        raise


def _check_pool(kv_caches, blocks_per_chunk, num_chunks, region, tensors, gpu, views, need):
    slot = _slot_bytes(region)
    gpu_groups, pages = group_tensors(kv_caches, gpu)
    if blocks_per_chunk > 1:
        for g, refs in enumerate(kv_caches.group_data_refs):
            for r, ref in enumerate(refs):
                padded = tensors[ref.tensor_idx].page_size_bytes
                if ref.page_size_bytes != padded:
                    raise ValueError(
                        f"kv_caches.group_data_refs[{g}][{r}].page_size_bytes: {ref.page_size_bytes} is "
                        f"less than kv_caches.tensors[{ref.tensor_idx}].page_size_bytes={padded}; vLLM's "
                        f"region keeps the {blocks_per_chunk} blocks of a chunk {padded} bytes apart, "
                        "kvoffload's pool page_size_bytes apart (a padded page needs blocks_per_chunk=1)")
    referenced = {ref.tensor_idx for refs in kv_caches.group_data_refs for ref in refs}
    for i in range(len(tensors)):
        if i not in referenced:
            raise ValueError(f"kv_caches.tensors[{i}]: no kv_caches.group_data_refs entry references it, "
                             "but vLLM's region keeps its place in every chunk row, which kvoffload's "
                             "pool cannot skip")
    counts = [num_chunks] * len(pages)
    owners = tensor_owners(gpu_groups)
    nbytes = pool_bytes(pages, counts, blocks_per_chunk, owners)
    base = views[0].data_ptr()
    region_base = region.base_tensor.data_ptr()
    available = region.total_size_bytes - (base - region_base)
    first_mismatch = None
    for layout in CPU_LAYOUTS:
        where = cpu_tensor_layouts(pages, counts, blocks_per_chunk, base, layout, owners)
        mismatch = _first_mismatch(kv_caches, views, where)
        if mismatch is None and nbytes <= available:
            return layout, base - region_base, nbytes, views
        if first_mismatch is None:
            first_mismatch = mismatch
    row = region._row_stride
    why = []
    if row != slot:
        why.append(f"a chunk's row of vLLM's region is {row} bytes and this worker's slot in it {slot} "
                   "(OffloadingConfig.parallel.world_size > 1 without replicated_layout, or "
                   "kv_bytes_per_chunk rounded up to the 4 KiB page)")
    if need != slot:
        why.append(f"the tensors fill {need} of the slot's {slot} bytes "
                   "(a kv_caches.tensors[i].page_size_bytes that OffloadingConfig."
                   "worker_kv_bytes_per_block does not count)")
    if first_mismatch is not None:
        why.append(first_mismatch)
    if nbytes > available:
        why.append(f"kvoffload's pool needs {nbytes} bytes, {available} are left in the region")
    raise ValueError("kv_caches: kvoffload's pool cannot lay its chunks out as vLLM's "
                     "SharedOffloadRegion does: " + "; ".join(why))


def _slot_bytes(region) -> int:
    """This worker's bytes in each chunk row (vLLM 0.32's region keeps only its bounds)."""
    slot = getattr(region, "cpu_page_size", None)
    return slot if slot is not None else region._worker_area_end - region._worker_offset


def _first_mismatch(kv_caches, views, where):
    """Where the first reference's pages would lie elsewhere in kvoffload's pool than in
    vLLM's view of its tensor (None: nowhere)."""
    for g, refs in enumerate(kv_caches.group_data_refs):
        for r, ref in enumerate(refs):
            view = views[ref.tensor_idx]
            ours, theirs = where[g][r], (view.data_ptr(), view.stride(0))
            if ours != theirs:
                base = views[0].data_ptr()
                return (f"kv_caches.group_data_refs[{g}][{r}] (kv_caches.tensors[{ref.tensor_idx}]) would "
                        f"start at byte {ours[0] - base} of the slot with chunks {ours[1]} bytes apart; "
                        f"vLLM's view has it at {theirs[0] - base}, {theirs[1]} apart")
    return None


def _check_handler(layout, kv_caches, views):
    """The handler's layout is the region's (a guard against kvoffload.host_pool changing)."""
    for g, refs in enumerate(kv_caches.group_data_refs):
        for r, ref in enumerate(refs):
            t, view = layout.groups[g].tensors[r], views[ref.tensor_idx]
            if (t.cpu_base, t.cpu_stride) != (view.data_ptr(), view.stride(0)):
                raise RuntimeError(f"kvoffload: the handler put group {g} tensor {r} at "
                                   f"{t.cpu_base:#x} stride {t.cpu_stride}, not at vLLM's view "
                                   f"{view.data_ptr():#x} stride {view.stride(0)}")
