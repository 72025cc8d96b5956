"""The straightforward per-block loop that kvoffload._C.PageTable maps ids with: the
specification its tests (and kv_model's byte model) check it against, and the baseline
its benchmark times."""

from __future__ import annotations

from kvoffload.pages.planner import CPUSpec, GPUSpec, KVLayout


def job_blocks(bpc, block_ids, group_sizes, block_indices, chunk_ids):
    """(group, block, chunk, sub-block) of every block a job names, in job order."""
    block_at, chunk_at = 0, 0
    for g, (n, first) in enumerate(zip(group_sizes, block_indices)):
        skip = first % bpc
        for i in range(n):
            yield g, int(block_ids[block_at + i]), int(chunk_ids[chunk_at + (skip + i) // bpc]), (skip + i) % bpc
        block_at += n
        chunk_at += 0 if n == 0 else (skip + n + bpc - 1) // bpc


def plan_per_block(layout: KVLayout, gpu: GPUSpec, cpu: CPUSpec) -> list[tuple[int, int, int]]:
    """(gpu address, cpu address, bytes) per block and tensor, tensor-major in each group."""
    by_group = [[] for _ in layout.groups]
    for g, block, chunk, sub in job_blocks(layout.blocks_per_chunk, gpu.block_ids, gpu.group_sizes,
                                           gpu.block_indices, cpu.chunk_ids):
        by_group[g].append((block, chunk, sub))
    copies = []
    for group, blocks in zip(layout.groups, by_group):
        for tensor in group.tensors:
            copies += [(tensor.gpu_base + block * tensor.gpu_stride,
                        tensor.cpu_base + chunk * tensor.cpu_stride + sub * tensor.page_bytes,
                        tensor.page_bytes) for block, chunk, sub in blocks]
    return copies
