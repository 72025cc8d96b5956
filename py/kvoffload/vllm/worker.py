"""vLLM's OffloadingWorker on kvoffload's OffloadHandler.

vLLM describes the cache as unique tensors ``kv_caches.tensors[i]`` (blocks along dim 0,
``page_size_bytes`` per block, padded) and, per group, references to them
(``group_data_refs[g][r]``: ``tensor_idx`` and the unpadded ``page_size_bytes`` moved per
block). Groups may reference one tensor (hybrid models). Chunk ids are global: chunk c
names the same chunk in every group, as vLLM's scheduler-side manager allocates them.
Stores, loads and expedited loads run on lanes of their own.
"""

from __future__ import annotations

import logging

import torch
from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec,
                                     OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from ..jobs.handler import OffloadHandler
from ..pages.planner import CPUSpec, GPUSpec
from ..util.arguments import is_int

logger = logging.getLogger(__name__)


def _block_view(entry, name: str) -> torch.Tensor:
    """The tensor as [num_blocks, page_size_bytes] int8, each block contiguous."""
    tensor, page = entry.tensor, entry.page_size_bytes
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}.tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    if not is_int(page) or page <= 0:
        raise ValueError(f"{name}.page_size_bytes: expected a positive int, got {page!r}")
    if tensor.dim() == 2 and tensor.dtype == torch.int8 and tensor.shape[1] == page:
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or nbytes % page:
        raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} tensor is not contiguous "
                         f"blocks of page_size_bytes={page}")
    if tensor.dim() == 0 or nbytes // page != tensor.shape[0]:
        raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} tensor holds {nbytes // page} pages "
                         f"of page_size_bytes={page}, not one per index of its first dimension (num_blocks)")
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
                if not is_int(value):
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
    (``method``, ``cpu_layout``, ``host_buffer``). Given CPU tensors, jobs
    run on host threads."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_cpu_chunks: int,
                 handler_tensors: tuple | None = None, **handler_options):
        views = [_block_view(t, f"kv_caches.tensors[{i}]") for i, t in enumerate(kv_caches.tensors)]
        devices = {str(v.device) for v in views}
        if len(devices) > 1:
            raise ValueError(f"kv_caches.tensors: on more than one device ({sorted(devices)})")
        # handler_tensors: (gpu_tensors, page_bytes) of views of these tensors, in place of
        # one per ref (canonical fragments).
        gpu_tensors, pages = handler_tensors if handler_tensors is not None else group_tensors(kv_caches, views)
        handler_options.setdefault("expedited_loads", True)
        self.handler = OffloadHandler(gpu_tensors, num_cpu_chunks, blocks_per_chunk,
                                      page_bytes=pages, **handler_options)

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        prefix = f"submit_store(job_id={job_id!r}): "
        gpu, cpu = _specs(prefix, src_spec, "src_spec", dst_spec, "dst_spec")
        return _submit(prefix, self.handler.store, job_id, gpu, cpu)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        prefix = f"submit_load(job_id={job_id!r}): "
        gpu, cpu = _specs(prefix, dst_spec, "dst_spec", src_spec, "src_spec")
        return _submit(prefix, self.handler.load, job_id, cpu, gpu, expedite=expedited)

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
        try:
            self.handler.wait(list(job_ids), ignore_unknown=True)  # a frozenset is several ids here
        except RuntimeError:
            if not self.handler.shut_down:  # as vLLM's worker, whose wait() after shutdown returns
                raise

    def shutdown(self) -> None:
        self.handler.shutdown()


def _submit(prefix, submit, *args, **kwargs) -> bool:
    try:
        return submit(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(prefix + str(e)) from e


def _specs(prefix, gpu_spec, gpu_name, cpu_spec, cpu_name) -> tuple[GPUSpec, CPUSpec]:
    """vLLM's specs as kvoffload's, which name vLLM's fields in their errors."""
    if not isinstance(gpu_spec, GPULoadStoreSpec):
        raise TypeError(f"{prefix}{gpu_name}: expected a GPULoadStoreSpec, got {type(gpu_spec).__name__}")
    if not isinstance(cpu_spec, CPULoadStoreSpec):
        raise TypeError(f"{prefix}{cpu_name}: expected a CPULoadStoreSpec, got {type(cpu_spec).__name__}")
    names = {field: f"{gpu_name}.{field}" for field in ("block_ids", "group_sizes", "block_indices")}
    try:
        gpu = GPUSpec(gpu_spec.block_ids, gpu_spec.group_sizes, gpu_spec.block_indices, names=names)
        cpu = CPUSpec(cpu_spec.block_ids, names={"chunk_ids": f"{cpu_name}.block_ids"})
    except (TypeError, ValueError) as e:
        raise type(e)(prefix + str(e)) from e
    return gpu, cpu
