"""The straightforward per-block loop that kvoffload._C.PageTable maps ids with: the
specification its tests check it against, and the baseline its benchmark times."""

from __future__ import annotations

from kvoffload.planner import CPUSpec, GPUSpec, KVLayout


def plan_per_block(layout: KVLayout, gpu: GPUSpec, cpu: CPUSpec) -> list[tuple[int, int, int]]:
    """(gpu address, cpu address, bytes) per block and tensor, tensor-major in each group."""
    bpc = layout.blocks_per_chunk
    copies = []
    block_at, chunk_at = 0, 0
    for g, group in enumerate(layout.groups):
        n = gpu.group_sizes[g]
        skip = gpu.block_indices[g] % bpc
        for tensor in group.tensors:
            for i in range(n):
                block = int(gpu.block_ids[block_at + i])
                chunk = int(cpu.chunk_ids[chunk_at + (skip + i) // bpc])
                sub = (skip + i) % bpc
                copies.append((tensor.gpu_base + block * tensor.gpu_stride,
                               tensor.cpu_base + chunk * tensor.cpu_stride + sub * tensor.page_bytes,
                               tensor.page_bytes))
        block_at += n
        chunk_at += 0 if n == 0 else (skip + n + bpc - 1) // bpc
    return copies
