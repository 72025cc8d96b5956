"""Where a handler's pool puts each tensor's chunks.

Layouts (``cpu_layout``):

- ``"chunk_major"``: for each group, chunk c is one contiguous run holding its
  ``blocks_per_chunk`` sub-blocks of tensor 0, then of tensor 1, and so on. A transfer's
  host side is then a few large runs, one per chunk: the staging ring's.
- ``"per_tensor"``: vLLM's layout; each tensor has its own ``[num_chunks, blocks_per_chunk
  * page]`` region. A handler takes it by default where its pages go by DMA
  (kvoffload.jobs.methods.cpu_layout_for).

Groups follow each other, each starting on a 4 KiB boundary. Groups that reference one
tensor (hybrid models) share its region, laid out as one group holding every tensor they
reference; a chunk id then names the same chunk in each of them.

Or the caller places the chunks in its own buffer: ``cpu_places[g][t] = (offset,
stride)`` puts chunk c of group g's tensor t at byte ``offset + c * stride``, its
``blocks_per_chunk`` pages one after another (``check_places``): a pool laid out by
someone else (vLLM's SharedOffloadRegion, its canonical pages) is taken as it is.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..pages.planner import KVLayout, alias_classes
from ..util.arguments import require_int
from .registrations import ChunkRun

CPU_LAYOUTS = ("chunk_major", "per_tensor")
_ALIGN = 4096


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _sections(pages, num_chunks, owners):
    """Groups that share a tensor (the same owner) share its CPU region: yields, per
    section of groups joined by shared tensors, (chunks, [(owner, pitch)], [group]),
    where a tensor's pitch is its largest page."""
    if owners is None:
        owners = [[(g, t) for t in range(len(p))] for g, p in enumerate(pages)]
    first = {}
    pairs = [(first.setdefault(o, g), g) for g, group in enumerate(owners) for o in group]
    alias = alias_classes(len(pages), pairs)
    for root in sorted(set(alias)):
        members = [g for g in range(len(pages)) if alias[g] == root]
        counts = {num_chunks[g] for g in members}
        if len(counts) > 1:
            raise ValueError(f"num_cpu_chunks: groups {members} share tensors but differ in "
                             f"chunk count ({sorted(counts)})")
        pitch = {}
        for g in members:
            for o, page in zip(owners[g], pages[g]):
                pitch[o] = max(pitch.get(o, 0), page)
        yield counts.pop(), list(pitch.items()), members


def _regions(pages, num_chunks, blocks_per_chunk, base, cpu_layout, owners):
    """Per section: (chunks, chunk bytes, {owner: (cpu_base, cpu_stride)}, [group])."""
    if cpu_layout not in CPU_LAYOUTS:
        raise ValueError(f"cpu_layout: expected one of {CPU_LAYOUTS}, got {cpu_layout!r}")
    at = base
    for chunks, pitches, members in _sections(pages, num_chunks, owners):
        chunk_bytes = blocks_per_chunk * sum(p for _, p in pitches)
        offset, where = 0, {}
        for owner, pitch in pitches:
            if cpu_layout == "chunk_major":
                where[owner] = (at + offset, chunk_bytes)
                offset += blocks_per_chunk * pitch
            else:
                where[owner] = (at + offset, blocks_per_chunk * pitch)
                offset += chunks * blocks_per_chunk * pitch
        yield chunks, chunk_bytes, where, members
        at += _align(chunk_bytes * chunks)


def pool_bytes(pages: Sequence[Sequence[int]], num_chunks: Sequence[int], blocks_per_chunk: int,
               owners=None) -> int:
    """Bytes a pool needs for groups with these page sizes ([group][tensor]) and chunk
    counts. owners[g][t] names tensor t's storage; groups naming one share its region."""
    return sum(_align(blocks_per_chunk * sum(p for _, p in pitches) * n)
               for n, pitches, _ in _sections(pages, num_chunks, owners))


def cpu_tensor_layouts(pages: Sequence[Sequence[int]], num_chunks: Sequence[int], blocks_per_chunk: int,
                       base: int, cpu_layout: str, owners=None) -> list[list[tuple[int, int]]]:
    """(cpu_base, cpu_stride) of every tensor, [group][tensor], for a pool at ``base``."""
    out = [[None] * len(p) for p in pages]
    for _, _, where, members in _regions(pages, num_chunks, blocks_per_chunk, base, cpu_layout, owners):
        for g in members:
            for t in range(len(pages[g])):
                out[g][t] = where[owners[g][t] if owners is not None else (g, t)]
    return out


def tensor_owners(gpu_tensors: Sequence[Sequence]) -> list[list[tuple[int, int, int]]]:
    """[group][tensor] -> (address, block stride, blocks): equal for references to one tensor."""
    return [[(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0]) for t in group]
            for group in gpu_tensors]


def kv_layout(gpu_tensors: Sequence[Sequence], pages: Sequence[Sequence[int]], num_chunks: Sequence[int],
              blocks_per_chunk: int, pool_base: int, cpu_layout: str) -> KVLayout:
    """The planner's layout for GPU tensors ([group][tensor], blocks along dim 0) and a
    pool; a tensor referenced by several groups has one CPU region, which they share."""
    cpu = cpu_tensor_layouts(pages, num_chunks, blocks_per_chunk, pool_base, cpu_layout,
                             tensor_owners(gpu_tensors))
    return KVLayout.from_parts(gpu_tensors, pages, cpu, num_chunks, blocks_per_chunk)


def chunk_runs(pages: Sequence[Sequence[int]], num_chunks: Sequence[int], blocks_per_chunk: int,
               cpu_layout: str, owners=None) -> list[ChunkRun]:
    """The byte runs of a pool ([group][tensor] pages) that only whole chunks (chunk_major)
    or a tensor's whole chunk slots (per_tensor) may be cut from."""
    runs = []
    for chunks, chunk_bytes, where, _ in _regions(pages, num_chunks, blocks_per_chunk, 0,
                                                  cpu_layout, owners):
        if cpu_layout == "chunk_major":
            starts = [min(start for start, _ in where.values())] if where else []
            runs += [ChunkRun(start, chunk_bytes, start + chunk_bytes * chunks) for start in starts]
        else:
            runs += [ChunkRun(start, stride, start + stride * chunks) for start, stride in where.values()]
    return runs


def chunks_reach(layout: KVLayout, chunk_ids: np.ndarray, chunks_per_group: Sequence[int]) -> int:
    """The address just past the furthest byte of a job's chunks (ids concatenated by
    group, ``chunks_per_group[g]`` of group g) in the pool of ``layout``."""
    reach, at = 0, 0
    for group, n in zip(layout.groups, chunks_per_group):
        if n and group.tensors:
            last = int(np.max(chunk_ids[at:at + n]))
            reach = max(reach, max(t.cpu_base + last * t.cpu_stride + layout.blocks_per_chunk * t.page_bytes
                                   for t in group.tensors))
        at += n
    return reach


def check_places(cpu_places, pages: Sequence[Sequence[int]], num_chunks: Sequence[int],
                 blocks_per_chunk: int, buffer_bytes: int) -> tuple[list[list[tuple[int, int]]], int]:
    """(the places as ints, the bytes they reach), or an error naming the entry at fault:
    one (offset, stride) per tensor, each tensor's chunks inside the buffer and a stride
    that holds a chunk. Overlaps are the layout's to refuse (KVLayout)."""
    if isinstance(cpu_places, (str, bytes)) or not isinstance(cpu_places, Sequence):
        raise TypeError(f"cpu_places: expected one sequence of (offset, stride) per group, "
                        f"got {type(cpu_places).__name__}")
    if len(cpu_places) != len(pages):
        raise ValueError(f"cpu_places: has {len(cpu_places)} groups but gpu_tensors has {len(pages)}")
    places, reach = [], 0
    for g, (group, group_pages) in enumerate(zip(cpu_places, pages)):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or len(group) != len(group_pages):
            raise ValueError(f"cpu_places[{g}]: expected {len(group_pages)} (offset, stride) pairs, "
                             f"one per tensor of gpu_tensors[{g}]")
        places.append([])
        for t, (place, page) in enumerate(zip(group, group_pages)):
            name = f"cpu_places[{g}][{t}]"
            if isinstance(place, (str, bytes)) or not isinstance(place, Sequence) or len(place) != 2:
                raise TypeError(f"{name}: expected (offset, stride), got {place!r}")
            offset = require_int(f"{name}[0]", place[0], 0)
            stride = require_int(f"{name}[1]", place[1], blocks_per_chunk * page)
            end = offset + (num_chunks[g] - 1) * stride + blocks_per_chunk * page if num_chunks[g] else offset
            if end > buffer_bytes:
                raise ValueError(f"{name}: chunk {num_chunks[g] - 1} ends at byte {end}, past the "
                                 f"{buffer_bytes} of host_buffer")
            places[g].append((offset, stride))
            reach = max(reach, end)
    return places, reach
