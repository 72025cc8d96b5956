"""Jobs named by ids: a KVLayout as a kvoffload._C.PageTable.

The table holds every tensor's geometry (GPU base, row stride and page bytes; CPU base
and chunk stride). A job then passes only its GPU block ids, CPU chunk ids and each
group's count and first logical index (GPUSpec, CPUSpec); the host checks the ids and
cuts the job into segments (one tensor's pages in one chunk), and the GPU computes
every page's addresses. ``table.copy(..., path=_C.PagePath.X)`` crosses the link as
cc/pages/page_copy.h says: STAGED (DMA through a device ring, a kernel on the HBM side),
KERNEL (a kernel that reaches the pool) or DMA (cuMemcpyBatchAsync per page).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from .. import _C
from ..util.vocabulary import Direction
from .planner import CPUSpec, GPUSpec, KVLayout, TransferPlan

PageTable = _C.PageTable
UNIT_BYTES = _C.PAGE_UNIT_BYTES


def page_table(layout: KVLayout, host_breaks=()) -> PageTable:
    """The layout's tensors as a PageTable (validated again there: no extent may wrap).
    host_breaks: host addresses where one page-locked registration of the pool ends and
    the next begins; no DMA crosses them."""
    refs = np.array([[t.gpu_base, t.gpu_stride, t.page_bytes, t.cpu_base, t.cpu_stride]
                     for group in layout.groups for t in group.tensors], dtype=np.int64).reshape(-1, 5)
    per_group = lambda f: np.array([f(g) for g in layout.groups], dtype=np.int64)
    return PageTable(refs, per_group(lambda g: len(g.tensors)), per_group(lambda g: g.num_gpu_blocks),
                     per_group(lambda g: g.num_cpu_chunks), layout.blocks_per_chunk,
                     np.ascontiguousarray(host_breaks, dtype=np.int64))


def key_offsets(layout: KVLayout, parts: "ChunkParts") -> tuple[np.ndarray, np.ndarray, int, int]:
    """Each group's first key in the flat numbering of every GPU block and of every CPU
    part (PageTable.keys, then parts.keys), groups that share tensors sharing their
    range; and how many keys each numbering has."""
    offsets = []
    for alias, count in ((layout.gpu_alias, lambda g: layout.groups[g].num_gpu_blocks),
                         (layout.cpu_alias, lambda g: layout.groups[g].num_cpu_chunks * parts.per_chunk[g])):
        first, total = {}, 0
        for g, root in enumerate(alias):
            if root not in first:
                first[root], total = total, total + count(g)
        offsets += [np.array([first[root] for root in alias], dtype=np.int64), total]
    gpu, gpu_keys, cpu, cpu_keys = offsets
    return gpu, cpu, gpu_keys, cpu_keys


@dataclasses.dataclass(frozen=True, eq=False)  # (arrays: compared by identity)
class ChunkParts:
    """What a CPU key names: a part, the most bytes of a chunk that every sub-block of
    the groups sharing its tensors covers whole or not at all. A job touching a key then
    touches all of its bytes, and the last job to write a key wrote every byte of it.
    Sub-block k of a group is part k unless groups share CPU tensors with other pages,
    or with other tensors beside them: sub-block k of one then covers other bytes than
    that of another, and is one part or more.

    per_chunk[g]: parts in a chunk of group g's class. of_sub_block[g]: [sub-block, i]
    -> its i-th part (-1 past its last), or None where sub-block k is part k."""

    blocks_per_chunk: int
    per_chunk: tuple[int, ...]
    of_sub_block: tuple[np.ndarray | None, ...]

    @classmethod
    def of(cls, layout: KVLayout) -> "ChunkParts":
        bpc, groups = layout.blocks_per_chunk, layout.groups
        per_chunk, of_sub_block = [bpc] * len(groups), [None] * len(groups)
        for root in set(layout.cpu_alias):
            members = [g for g, r in enumerate(layout.cpu_alias) if r == root]
            pages = collections.defaultdict(list)  # a tensor's CPU base -> (group, page) of each reference
            for g in members:
                for t in groups[g].tensors:
                    pages[t.cpu_base].append((g, t.page_bytes))
            # A part: the (sub-block, group)s that cover a byte, cut where any begins or ends.
            parts = set()
            for refs in pages.values():
                cuts = sorted({k * page for _, page in refs for k in range(bpc + 1)})
                parts |= {tuple(sorted((at // page, g) for g, page in refs if at < bpc * page)) for at in cuts[:-1]}
            parts = sorted(parts)  # sub-block k is part k where that is all there is
            covers = {(k, g): [] for g in members for k in range(bpc)}
            for i, part in enumerate(parts):
                for k_g in part:
                    covers[k_g].append(i)
            if parts == [tuple((k, g) for g in members) for k in range(bpc)]:
                continue
            width = max(map(len, covers.values()))
            for g in members:
                per_chunk[g] = len(parts)
                of_sub_block[g] = np.array([covers[k, g] + [-1] * (width - len(covers[k, g])) for k in range(bpc)],
                                           dtype=np.int64).reshape(bpc, width)
        return cls(bpc, tuple(per_chunk), tuple(of_sub_block))

    def keys(self, cpu_keys: np.ndarray, group_sizes, cpu_offset: np.ndarray) -> np.ndarray:
        """PageTable.keys' CPU keys (cpu_offset[g] + chunk * blocks_per_chunk + sub-block,
        concatenated by group) as the keys of their parts."""
        if all(parts is None for parts in self.of_sub_block):
            return cpu_keys
        bounds = np.concatenate(([0], np.cumsum(group_sizes, dtype=np.int64)))
        out = []
        for g, parts in enumerate(self.of_sub_block):
            keys = cpu_keys[bounds[g]:bounds[g + 1]]
            if parts is not None:
                chunk, sub = np.divmod(keys - cpu_offset[g], self.blocks_per_chunk)
                covered = parts[sub]
                keys = ((cpu_offset[g] + chunk * self.per_chunk[g])[:, None] + covered)[covered >= 0]
            out.append(keys)
        return np.concatenate(out)


def job_arguments(gpu: GPUSpec, cpu: CPUSpec) -> tuple:
    """(block_ids, chunk_ids, group_sizes, block_indices), as the table's calls take them."""
    return gpu.block_ids, cpu.chunk_ids, list(gpu.group_sizes), list(gpu.block_indices)


def job_names(gpu: GPUSpec, cpu: CPUSpec) -> tuple[str, str, str, str] | None:
    """What the specs call job_arguments' four arrays (PageTable.prepare's names)."""
    if gpu.names is None and cpu.names is None:
        return None
    return gpu.name("block_ids"), cpu.name("chunk_ids"), gpu.name("group_sizes"), gpu.name("block_indices")


def transfer_plan(table: PageTable, job, direction: Direction | str) -> TransferPlan:
    """The copies of a job ``table.prepare`` checked (PageTable.page_copies), as the
    methods that plan on the host take them, in the DMA order of ``direction``."""
    gpu, host, size = table.page_copies(job, Direction.parse(direction, "direction").native)
    return TransferPlan(gpu, host, size, int(size.sum()))
