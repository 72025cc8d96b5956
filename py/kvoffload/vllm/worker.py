"""vLLM's OffloadingWorker on kvoffload's OffloadHandler.

vLLM describes the cache as unique tensors ``kv_caches.tensors[i]`` (blocks along dim 0,
``page_size_bytes`` per block, padded) and, per group, references to them
(``group_data_refs[g][r]``: ``tensor_idx`` and the unpadded ``page_size_bytes`` moved per
block). Groups may reference one tensor (hybrid models). Chunk ids are global: chunk c of
every group is row c of the pool, as vLLM's scheduler-side manager allocates them.
Stores, loads and expedited loads run on lanes of their own.
"""

from __future__ import annotations

import functools
import logging
import re

import torch
from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec,
                                     OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvoffload.handler import OffloadHandler
from kvoffload.planner import CPUSpec, GPUSpec

logger = logging.getLogger(__name__)


def _block_view(entry, name: str) -> torch.Tensor:
    """The tensor as [num_blocks, page_size_bytes] int8, each block contiguous."""
    tensor, page = entry.tensor, entry.page_size_bytes
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}.tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(page, bool) or not isinstance(page, int) or page <= 0:
        raise ValueError(f"{name}.page_size_bytes: expected a positive int, got {page!r}")
    if tensor.dim() == 2 and tensor.dtype == torch.int8 and tensor.shape[1] == page:
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or nbytes % page:
        raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} tensor is not contiguous "
                         f"blocks of page_size_bytes={page}")
    return tensor.view(torch.int8).view(-1, page)


def group_tensors(kv_caches: CanonicalKVCaches, views: list) -> tuple[list, list]:
    """Per group, the block views its refs name and the bytes each moves a block, checked
    against vLLM's fields: ``(gpu_tensors, page_bytes)`` as OffloadHandler takes them."""
    gpu_tensors, pages = [], []
    for g, refs in enumerate(kv_caches.group_data_refs):
        gpu_tensors.append([]), pages.append([])
        for r, ref in enumerate(refs):
            name = f"kv_caches.group_data_refs[{g}][{r}]"
            for field in ("tensor_idx", "page_size_bytes"):
                value = getattr(ref, field)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"{name}.{field}: expected an int, got {type(value).__name__}")
            if not 0 <= ref.tensor_idx < len(views):
                raise ValueError(f"{name}.tensor_idx: {ref.tensor_idx} is out of range "
                                 f"[0, {len(views)})")
            padded = views[ref.tensor_idx].shape[1]
            if not 0 < ref.page_size_bytes <= padded:
                raise ValueError(f"{name}.page_size_bytes: {ref.page_size_bytes} is not in "
                                 f"(0, {padded}], the page of tensor {ref.tensor_idx}")
            gpu_tensors[g].append(views[ref.tensor_idx])
            pages[g].append(ref.page_size_bytes)
    if not any(gpu_tensors):
        raise ValueError(f"kv_caches: no tensors to offload ({len(views)} tensors, "
                         f"{len(gpu_tensors)} groups, none referencing a tensor)")
    return gpu_tensors, pages


class KVOffloadWorker(OffloadingWorker):
    """Moves blocks between vLLM's KV-cache tensors and a host pool of ``num_cpu_chunks``
    chunks of ``blocks_per_chunk`` blocks. Keyword arguments go to OffloadHandler
    (``method``, ``max_slowdown``, ``cpu_layout``, ``host_buffer``). Given CPU tensors, jobs
    run on host threads."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_cpu_chunks: int,
                 **handler_options):
        views = [_block_view(t, f"kv_caches.tensors[{i}]") for i, t in enumerate(kv_caches.tensors)]
        devices = {str(v.device) for v in views}
        if len(devices) > 1:
            raise ValueError(f"kv_caches.tensors: on more than one device ({sorted(devices)})")
        gpu_tensors, pages = group_tensors(kv_caches, views)
        handler_options.setdefault("expedited_loads", True)
        self.handler = OffloadHandler(gpu_tensors, num_cpu_chunks, blocks_per_chunk,
                                      page_bytes=pages, **handler_options)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        gpu, cpu = _specs("submit_store", job_id, src_spec, "src_spec", dst_spec, "dst_spec")
        return self._submit("submit_store", job_id, functools.partial(self.handler.store, job_id, gpu, cpu),
                            {"block_ids": "src_spec.block_ids", "chunk_ids": "dst_spec.block_ids"})

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        gpu, cpu = _specs("submit_load", job_id, dst_spec, "dst_spec", src_spec, "src_spec")
        return self._submit("submit_load", job_id,
                            functools.partial(self.handler.load, job_id, cpu, gpu, expedite=expedited),
                            {"block_ids": "dst_spec.block_ids", "chunk_ids": "src_spec.block_ids"})

    def _submit(self, verb, job_id, submit, fields) -> bool:
        try:
            return submit()
        except (TypeError, ValueError) as e:
            spec = "src_spec" if verb == "submit_store" else "dst_spec"
            fields = {**fields, "group_sizes": f"{spec}.group_sizes",
                      "block_indices": f"{spec}.block_indices"}
            message = re.sub(r"\b(block_ids|chunk_ids|group_sizes|block_indices)\b",
                             lambda m: fields[m.group(1)], str(e))
            raise type(e)(f"{verb}(job_id={job_id!r}): {message}") from e

    def get_finished(self) -> list[TransferResult]:
        results = []
        for r in self.handler.get_finished():
            if not r.success:
                logger.error("kvoffload: %s job %r failed: %s", r.direction.value, r.job_id, r.error)
            results.append(TransferResult(r.job_id, r.success, r.bytes, r.seconds))
        return results

    def wait(self, job_ids: set[int]) -> None:
        # Ids this worker never saw return at once, as in vLLM's CPUOffloadingWorker: under
        # the replicated layout vLLM's connector skips the stores of every rank but 0, then
        # waits for them on every rank (OffloadingConnectorWorker.handle_preemptions).
        self.handler.wait(job_ids, ignore_unknown=True)

    def shutdown(self) -> None:
        self.handler.shutdown()


def _specs(verb, job_id, gpu_spec, gpu_name, cpu_spec, cpu_name) -> tuple[GPUSpec, CPUSpec]:
    if not isinstance(gpu_spec, GPULoadStoreSpec):
        raise TypeError(f"{verb}(job_id={job_id!r}): {gpu_name}: expected a GPULoadStoreSpec, "
                        f"got {type(gpu_spec).__name__}")
    if not isinstance(cpu_spec, CPULoadStoreSpec):
        raise TypeError(f"{verb}(job_id={job_id!r}): {cpu_name}: expected a CPULoadStoreSpec, "
                        f"got {type(cpu_spec).__name__}")
    prefix = f"{verb}(job_id={job_id!r}): "
    fields = []
    for field in ("group_sizes", "block_indices"):
        value = getattr(gpu_spec, field)
        try:
            fields.append(tuple(value))
        except TypeError:
            raise TypeError(f"{prefix}{gpu_name}.{field}: expected a sequence of ints, got "
                            f"{type(value).__name__}") from None
    try:
        gpu = GPUSpec(gpu_spec.block_ids, *fields)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{prefix}{gpu_name}.{e}") from e
    try:
        cpu = CPUSpec(cpu_spec.block_ids)
    except (TypeError, ValueError) as e:
        raise type(e)(prefix + re.sub(r"\bchunk_ids\b", f"{cpu_name}.block_ids", str(e))) from e
    return gpu, cpu
