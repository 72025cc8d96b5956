"""The CPU pool a handler offloads into: pinned host memory and its layout.

Layouts (``cpu_layout``):

- ``"chunk_major"`` (default): for each group, chunk c is one contiguous run holding its
  ``blocks_per_chunk`` sub-blocks of tensor 0, then of tensor 1, and so on. A transfer's
  host side is then a few large runs, one per chunk.
- ``"per_tensor"``: vLLM's layout; each tensor has its own ``[num_chunks, blocks_per_chunk
  * page]`` region.

Groups follow each other, each starting on a 4 KiB boundary. Groups that reference one
tensor (hybrid models) share its region, laid out as one group holding every tensor they
reference; a chunk id then names the same chunk in each of them.
"""

from __future__ import annotations

from typing import Sequence

from kvoffload import _C
from kvoffload.planner import GroupLayout, KVLayout, TensorLayout, alias_classes

CPU_LAYOUTS = ("chunk_major", "per_tensor")
_ALIGN = 4096


class PinnedMemoryError(RuntimeError):
    """Host memory could not be page-locked; transfers would be slow or unsafe."""


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


def pool_bytes(pages: Sequence[Sequence[int]], num_chunks: Sequence[int], blocks_per_chunk: int,
               owners=None) -> int:
    """Bytes a pool needs for groups with these page sizes ([group][tensor]) and chunk
    counts. owners[g][t] names tensor t's storage; groups naming one share its region."""
    return sum(_align(blocks_per_chunk * sum(p for _, p in pitches) * n)
               for n, pitches, _ in _sections(pages, num_chunks, owners))


def cpu_tensor_layouts(pages: Sequence[Sequence[int]], num_chunks: Sequence[int], blocks_per_chunk: int,
                       base: int, cpu_layout: str, owners=None) -> list[list[tuple[int, int]]]:
    """(cpu_base, cpu_stride) of every tensor, [group][tensor], for a pool at ``base``."""
    if cpu_layout not in CPU_LAYOUTS:
        raise ValueError(f"cpu_layout: expected one of {CPU_LAYOUTS}, got {cpu_layout!r}")
    out, at = [[None] * len(p) for p in pages], base
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
        for g in members:
            for t in range(len(pages[g])):
                out[g][t] = where[owners[g][t] if owners is not None else (g, t)]
        at += _align(chunk_bytes * chunks)
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
    groups = []
    for g, tensors in enumerate(gpu_tensors):
        layouts = tuple(
            TensorLayout(gpu_base=t.data_ptr(), gpu_stride=t.stride(0) * t.element_size(),
                         page_bytes=pages[g][i], cpu_base=cpu[g][i][0], cpu_stride=cpu[g][i][1])
            for i, t in enumerate(tensors))
        blocks = {t.shape[0] for t in tensors}
        if len(blocks) > 1:
            raise ValueError(f"gpu_tensors[{g}]: tensors of one group differ in block count")
        groups.append(GroupLayout(layouts, blocks.pop() if blocks else 0, num_chunks[g]))
    return KVLayout(tuple(groups), blocks_per_chunk)


class HostPool:
    """A host buffer of ``nbytes``: allocated pinned, or the caller's, page-locked here.

    ``pinned=False`` (machines without a GPU) takes ordinary memory.
    """

    def __init__(self, torch, nbytes: int, buffer=None, pinned: bool = True):
        self._registered = False
        self.nbytes = nbytes
        if buffer is None:
            self.tensor = self._allocate(torch, nbytes, pinned)
        else:
            self.tensor = self._adopt(buffer, nbytes)
            if pinned and not _C.is_pinned_host(buffer.data_ptr()):
                try:
                    _C.host_register(buffer.data_ptr(), buffer.numel() * buffer.element_size())
                except _C.CudaError as e:
                    raise PinnedMemoryError(f"host_buffer: could not page-lock {nbytes} bytes: {e}") from e
                self._registered = True
        self.base = self.tensor.data_ptr()

    @staticmethod
    def _allocate(torch, nbytes, pinned):
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        except RuntimeError as e:
            raise PinnedMemoryError(f"could not allocate {nbytes} bytes of pinned host memory: {e}") from e

    @staticmethod
    def _adopt(buffer, nbytes):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("host_buffer: must be a contiguous CPU tensor")
        if buffer.numel() * buffer.element_size() < nbytes:
            raise ValueError(f"host_buffer: holds {buffer.numel() * buffer.element_size()} bytes, "
                             f"the layout needs {nbytes}")
        return buffer

    def release(self) -> None:
        if self._registered:
            _C.host_unregister(self.base)
            self._registered = False
