"""kvoffload's vLLM worker on vLLM's ``SharedOffloadRegion``, the CPU primary tier of
vLLM's tiering (kvoffload.vllm.tiering builds it there).

The region is an mmap of /dev/shm/vllm_offload_<engine_id>.mmap: the scheduler side maps
it whole and vLLM's secondary tiers read and write chunk c as row c of that mapping;
each worker maps it again and moves blocks through one view per KV-cache tensor.
``KVOffloadRegionWorker``'s handler takes those views as they lie in the region
(``cpu_places``), so the bytes a store writes are the bytes the tiers read, and a chunk
a tier promotes is what a load reads.

With ``canonical_layout=True`` the region holds vLLM's parallelism-free pages (one per
block, ``CanonicalPageMapping``): each local page moves as the fragments its mapping
gives, each fragment a tensor of the handler's (a column slice of the GPU tensor, placed
where its canonical bytes go), so the page table addresses them on the GPU like any
other pages. Where several ranks hold the same bytes, each stores only the blocks vLLM
elects it the writer of. A chunk of more than one block needs unpadded pages, and
canonical pages one block per chunk.
"""
from __future__ import annotations

import dataclasses
import traceback

from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from ..util.arguments import is_int
from .worker import KVOffloadWorker, _block_view, _specs, _submit, group_tensors


class KVOffloadRegionWorker(KVOffloadWorker):
    """KVOffloadWorker whose pool is ``region``'s memory, each tensor (or canonical
    fragment) where vLLM's worker view has it. Owns ``region`` once constructed:
    ``shutdown()`` releases it after the handler."""

    def __init__(self, kv_caches, blocks_per_chunk: int, num_cpu_chunks: int,
                 region: SharedOffloadRegion, canonical_layout: bool = False, **handler_options):
        for key in ("host_buffer", "host_pool", "cpu_places"):
            if key in handler_options:
                raise ValueError(f"{key}: the pool is vLLM's SharedOffloadRegion; it cannot be given")
        if "cpu_layout" in handler_options:
            raise ValueError(f"kv_connector_extra_config: kvoffload_cpu_layout="
                             f"{handler_options['cpu_layout']!r} cannot be given: the layout is that of "
                             "vLLM's SharedOffloadRegion; leave it unset")
        self.region = self.region_views = None
        pool = _region_pool(kv_caches, blocks_per_chunk, num_cpu_chunks, region, canonical_layout)
        self.region, self.region_views = region, pool.views
        self._writers = pool.writers
        try:
            super().__init__(kv_caches, blocks_per_chunk, num_cpu_chunks, handler_tensors=(pool.gpu, pool.pages),
                             host_buffer=pool.buffer, cpu_places=pool.places, **handler_options)
        except BaseException as e:
            # So that the caller's region.cleanup() can unmap it: no view of the region may
            # stay in this frame or in those the traceback keeps.
            self.region_views = pool = None
            traceback.clear_frames(e.__traceback__)
            raise
        try:
            _check_handler(self.handler.layout, pool)
        except BaseException:
            self.shutdown()
            raise

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        if any(w is not None for w in self._writers):
            # The whole job is checked first: every rank refuses what any rank would.
            prefix = f"submit_store(job_id={job_id!r}): "
            gpu, cpu = _specs(prefix, src_spec, "src_spec", dst_spec, "dst_spec")
            _submit(prefix, self.handler.check, gpu, cpu)
            src_spec, dst_spec = _written(src_spec, dst_spec, self._writers)
        return super().submit_store(job_id, src_spec, dst_spec)

    def shutdown(self) -> None:
        """Waits for every job, releases the handler, then the region (vLLM's mapping of
        it, and the file if this worker made it)."""
        try:
            super().shutdown()
        except BaseException:
            handler = getattr(self, "handler", None)
            if handler is None or handler.shut_down:  # not one interrupted, whose jobs may still run
                self._release_region()
            raise
        self._release_region()

    def _release_region(self) -> None:
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


@dataclasses.dataclass
class _RegionPool:
    """What the handler takes: its GPU tensors [group][tensor] (whole pages, or canonical
    fragments) with the bytes each moves a block, their places in ``buffer`` (a span of
    the region), vLLM's views (held until shutdown), and per group the (num_writers,
    writer_index) of a canonical store (None: every block)."""

    gpu: list
    pages: list
    places: list
    buffer: object
    views: list
    writers: list


def _region_pool(kv_caches, blocks_per_chunk, num_chunks, region, canonical) -> _RegionPool:
    tensors = list(getattr(kv_caches, "tensors", None) or ())
    if not tensors:
        raise ValueError("kv_caches.tensors: no tensors to offload")
    gpu = [_block_view(t, f"kv_caches.tensors[{i}]") for i, t in enumerate(tensors)]
    gpu_groups, pages = group_tensors(kv_caches, gpu)
    if canonical:
        sizes = _canonical_sizes(kv_caches, len(tensors))
        views = _views(tensors, lambda i, t: region.create_next_canonical_view(sizes[i] * blocks_per_chunk),
                       [s * blocks_per_chunk for s in sizes], region._row_stride, "a row of vLLM's region")
    else:
        if blocks_per_chunk > 1:
            _refuse_padding(kv_caches, tensors, blocks_per_chunk)
        views = _views(tensors, lambda i, t: region.create_next_worker_view(blocks_per_chunk * t.page_size_bytes),
                       [blocks_per_chunk * t.page_size_bytes for t in tensors], _slot_bytes(region),
                       "this worker's slot in a row of vLLM's region")
    try:
        base = region.base_tensor.data_ptr()
        starts = [v.data_ptr() - base for v in views]
        ends = [s + (num_chunks - 1) * v.stride(0) + v.shape[1] for s, v in zip(starts, views)]
        first, last = min(starts), max(ends)
        view = None
        gpu_out, pages_out, places, writers = [], [], [], []
        mapped = {}  # tensor_idx -> (group, ref, runs) of its first canonical ref
        for g, refs in enumerate(kv_caches.group_data_refs):
            gpu_out.append([]), pages_out.append([]), places.append([])
            group_writers = set()
            for r, ref in enumerate(refs):
                view, start = views[ref.tensor_idx], starts[ref.tensor_idx] - first
                if not canonical:
                    gpu_out[g].append(gpu_groups[g][r])
                    pages_out[g].append(pages[g][r])
                    places[g].append((start, view.stride(0)))
                    continue
                m = ref.mapping
                _check_runs(f"kv_caches.group_data_refs[{g}][{r}].mapping", m, ref.page_size_bytes)
                runs = mapped.setdefault(ref.tensor_idx, (g, r, m.runs))
                if runs[2] != m.runs:
                    raise ValueError(
                        f"kv_caches.group_data_refs[{g}][{r}].mapping: its runs differ from those of "
                        f"kv_caches.group_data_refs[{runs[0]}][{runs[1]}], which maps the same tensor "
                        f"(kv_caches.tensors[{ref.tensor_idx}]); kvoffload needs one mapping per tensor")
                group_writers.add((m.num_writers, m.writer_index))
                for run in m.runs:
                    for k in range(run.num_fragments):
                        local = run.local_offset + k * run.local_stride
                        gpu_out[g].append(gpu_groups[g][r][:, local:local + run.fragment_size])
                        pages_out[g].append(run.fragment_size)
                        places[g].append((start + run.canonical_offset + k * run.canonical_stride,
                                          view.stride(0)))
            if len(group_writers) > 1:
                raise ValueError(f"kv_caches.group_data_refs[{g}]: its refs' mappings elect different "
                                 f"writers ({sorted(group_writers)} as (num_writers, writer_index)); "
                                 "kvoffload stores one set of blocks per group")
            writer = group_writers.pop() if group_writers else None
            writers.append(writer if writer is not None and writer[0] > 1 else None)
        return _RegionPool(gpu_out, pages_out, places, region.base_tensor[first:last], views, writers)
    except BaseException:
        views.clear()  # the traceback keeps this frame: no view of the region may stay in it
        view = None  # noqa: F841
        raise


def _views(tensors, make, need, limit, where) -> list:
    """The region's views of every tensor, in vLLM's order, once they are known to fit."""
    if sum(need) > limit:
        raise ValueError(
            f"kv_caches.tensors: {len(tensors)} tensors of page_size_bytes "
            f"{[t.page_size_bytes for t in tensors]} need {sum(need)} bytes per chunk, more than the "
            f"{limit} of {where} (OffloadingConfig.worker_kv_bytes_per_block * blocks_per_chunk)")
    return [make(i, t) for i, t in enumerate(tensors)]


def _check_runs(name, mapping, page) -> None:
    """Every fragment of ``mapping`` lies inside the local page and the canonical page."""
    if mapping.local_page_size_bytes != page:
        raise ValueError(f"{name}.local_page_size_bytes: {mapping.local_page_size_bytes} is not the "
                         f"ref's page_size_bytes={page}")
    if not is_int(mapping.num_writers) or mapping.num_writers < 1:
        raise ValueError(f"{name}.num_writers: expected an int >= 1, got {mapping.num_writers!r}")
    if not is_int(mapping.writer_index) or not 0 <= mapping.writer_index < mapping.num_writers:
        raise ValueError(f"{name}.writer_index: expected an int in [0, {mapping.num_writers}), "
                         f"got {mapping.writer_index!r}")
    for k, run in enumerate(mapping.runs):
        fields = ("local_offset", "canonical_offset", "fragment_size", "num_fragments", "local_stride",
                  "canonical_stride")
        for field in fields:
            value = getattr(run, field)
            least = 1 if field in ("fragment_size", "num_fragments") else 0
            if not is_int(value) or value < least:
                raise ValueError(f"{name}.runs[{k}].{field}: expected an int >= {least}, got {value!r}")
        last = int(run.num_fragments) - 1  # (Python ints: numpy's would wrap past 2^63)
        for side, offset, stride, limit in (
                ("local", run.local_offset, run.local_stride, page),
                ("canonical", run.canonical_offset, run.canonical_stride, mapping.canonical_page_size_bytes)):
            end = int(offset) + last * int(stride) + int(run.fragment_size)
            if end > limit:
                raise ValueError(f"{name}.runs[{k}]: its last fragment ends at byte {end} of the {side} "
                                 f"page, which has {limit}")


def _canonical_sizes(kv_caches, count) -> list[int]:
    """Each tensor's canonical page: the largest its refs' mappings give (vLLM's rule)."""
    sizes = [0] * count
    for refs in kv_caches.group_data_refs:
        for ref in refs:
            sizes[ref.tensor_idx] = max(sizes[ref.tensor_idx], ref.mapping.canonical_page_size_bytes)
    return sizes


def _refuse_padding(kv_caches, tensors, blocks_per_chunk) -> None:
    for g, refs in enumerate(kv_caches.group_data_refs):
        for r, ref in enumerate(refs):
            padded = tensors[ref.tensor_idx].page_size_bytes
            if ref.page_size_bytes != padded:
                raise ValueError(
                    f"kv_caches.group_data_refs[{g}][{r}].page_size_bytes: {ref.page_size_bytes} is "
                    f"less than kv_caches.tensors[{ref.tensor_idx}].page_size_bytes={padded}; vLLM's "
                    f"region keeps the {blocks_per_chunk} blocks of a chunk {padded} bytes apart, "
                    "kvoffload's pool page_size_bytes apart (a padded page needs blocks_per_chunk=1)")


def _slot_bytes(region) -> int:
    """This worker's bytes in each chunk row (vLLM 0.32's region keeps only its bounds)."""
    slot = getattr(region, "cpu_page_size", None)
    return slot if slot is not None else region._worker_area_end - region._worker_offset


def _written(gpu_spec, cpu_spec, writers):
    """The blocks of a canonical store this rank writes: vLLM elects block b of chunk c
    (one block per chunk) to writer c % num_writers."""
    ids, chunks = list(gpu_spec.block_ids), list(cpu_spec.block_ids)
    block_ids, chunk_ids, sizes, at = [], [], [], 0
    for n, writer in zip(gpu_spec.group_sizes, writers):
        pairs = list(zip(ids[at:at + n], chunks[at:at + n]))
        if writer is not None:
            pairs = [(b, c) for b, c in pairs if c % writer[0] == writer[1]]
        block_ids += [b for b, _ in pairs]
        chunk_ids += [c for _, c in pairs]
        sizes.append(len(pairs))
        at += n
    return (GPULoadStoreSpec(block_ids, sizes, list(gpu_spec.block_indices)), CPULoadStoreSpec(chunk_ids))


def _check_handler(layout, pool) -> None:
    """The handler's layout is the region's (a guard against kvoffload.pool.layout changing)."""
    base = pool.buffer.data_ptr()
    for g, places in enumerate(pool.places):
        for r, (offset, stride) in enumerate(places):
            t = layout.groups[g].tensors[r]
            if (t.cpu_base, t.cpu_stride) != (base + offset, stride):
                raise RuntimeError(f"kvoffload: the handler put group {g} tensor {r} at {t.cpu_base:#x} "
                                   f"stride {t.cpu_stride}, not at vLLM's {base + offset:#x} stride {stride}")
