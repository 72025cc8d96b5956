"""Jobs named by ids: a KVLayout as a kvoffload._C.PageTable.

The table holds every tensor's geometry (GPU base, row stride and page bytes; CPU base
and chunk stride). A job then passes only its GPU block ids, CPU chunk ids and each
group's count and first logical index (GPUSpec, CPUSpec); the host checks the ids and
cuts the job into segments (one tensor's pages in one chunk), and the GPU computes
every page's addresses. ``table.copy(..., staged=True)`` moves host runs by DMA through
a device staging ring and scatters (loads) or gathers (stores) the HBM side with a
kernel; ``staged=False`` has the kernel read or write the page-locked pool directly.
"""

from __future__ import annotations

import numpy as np

from kvoffload import _C
from kvoffload.planner import CPUSpec, GPUSpec, KVLayout

PageTable = _C.PageTable
UNIT_BYTES = _C.PAGE_UNIT_BYTES


def page_table(layout: KVLayout, host_breaks=()) -> PageTable:
    """The layout's tensors as a PageTable (validated again there: no extent may wrap).
    host_breaks: host addresses where one page-locked registration of the pool ends and
    the next begins; no DMA crosses them."""
    refs = np.array([[t.gpu_base, t.gpu_stride, t.page_bytes, t.cpu_base, t.cpu_stride]
                     for group in layout.groups for t in group.tensors], dtype=np.int64).reshape(-1, 5)
    return PageTable(refs, [len(g.tensors) for g in layout.groups],
                     [g.num_gpu_blocks for g in layout.groups],
                     [g.num_cpu_chunks for g in layout.groups], layout.blocks_per_chunk,
                     np.asarray(host_breaks, dtype=np.int64))


def key_offsets(layout: KVLayout) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Each group's first key in the flat numbering of every GPU block and of every CPU
    sub-block (PageTable.keys), groups that share tensors sharing their range;
    and how many keys each numbering has."""
    offsets = []
    for alias, count in ((layout.gpu_alias, lambda g: g.num_gpu_blocks),
                         (layout.cpu_alias, lambda g: g.num_cpu_chunks * layout.blocks_per_chunk)):
        first, total = {}, 0
        for g, root in enumerate(alias):
            if root not in first:
                first[root], total = total, total + count(layout.groups[g])
        offsets += [np.array([first[root] for root in alias], dtype=np.int64), total]
    gpu, gpu_keys, cpu, cpu_keys = offsets
    return gpu, cpu, gpu_keys, cpu_keys


def chunk_keyed_groups(layout: KVLayout) -> list[int]:
    """The groups that share CPU tensors with a group of other page sizes: sub-block k of
    a chunk lies at other bytes in each, so only whole chunks can name what they touch."""
    pages = [tuple(t.page_bytes for t in group.tensors) for group in layout.groups]
    return [g for g, root in enumerate(layout.cpu_alias)
            if any(layout.cpu_alias[h] == root and pages[h] != pages[g] for h in range(len(pages)))]


def whole_chunks(cpu_keys: np.ndarray, group_sizes, groups, cpu_offset, blocks_per_chunk: int) -> None:
    """Rounds these groups' CPU keys down to their chunk's first key, in place."""
    bounds = np.concatenate(([0], np.cumsum(group_sizes, dtype=np.int64)))
    for g in groups:
        keys = cpu_keys[bounds[g]:bounds[g + 1]]
        keys -= (keys - cpu_offset[g]) % blocks_per_chunk


def job_arguments(gpu: GPUSpec, cpu: CPUSpec) -> tuple:
    """(block_ids, chunk_ids, group_sizes, block_indices), as the table's calls take them."""
    return gpu.block_ids, cpu.chunk_ids, list(gpu.group_sizes), list(gpu.block_indices)
