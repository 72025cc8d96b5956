"""Chunks placed by the caller in its own host buffer: ``cpu_places[g][t] = (offset,
stride)`` puts chunk c of group g's tensor t at byte ``offset + c * stride`` of the
buffer, its ``blocks_per_chunk`` pages one after another. This is how a pool laid out by
someone else (vLLM's SharedOffloadRegion, its canonical pages) is taken as it is."""

from __future__ import annotations

from typing import Sequence

from kvoffload.planner import _require_int


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
            offset = _require_int(f"{name}[0]", place[0], 0)
            stride = _require_int(f"{name}[1]", place[1], blocks_per_chunk * page)
            end = offset + (num_chunks[g] - 1) * stride + blocks_per_chunk * page if num_chunks[g] else offset
            if end > buffer_bytes:
                raise ValueError(f"{name}: chunk {num_chunks[g] - 1} ends at byte {end}, past the "
                                 f"{buffer_bytes} of host_buffer")
            places[g].append((offset, stride))
            reach = max(reach, end)
    return places, reach
