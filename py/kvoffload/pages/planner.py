"""Multi-group KV-cache layouts and the specs of a transfer.

A KV cache is a list of groups (KVLayout); a group has tensors (one per layer, or per
layer and K/V) that share a block count on the GPU and a chunk count on the CPU. GPU
block b of a tensor starts at ``gpu_base + b * gpu_stride`` and holds ``page_bytes``
(which may be less than the stride). A CPU chunk holds ``blocks_per_chunk`` consecutive
blocks of one tensor: sub-block j of chunk c starts at
``cpu_base + c * cpu_stride + j * page_bytes``.

A transfer names GPU blocks and CPU chunks as vLLM's offload worker does (GPUSpec,
CPUSpec). For group g with n blocks whose first logical index is b, the first
``skip = b % blocks_per_chunk`` sub-blocks of its first chunk are left alone: block i
goes to chunk ``(skip + i) // blocks_per_chunk``, sub-block ``(skip + i) % blocks_per_chunk``.
The ids become addresses in one place, kvoffload._C.PageTable (kvoffload.pages.table);
one TransferPlan serves both directions, store (GPU -> CPU) and load (CPU -> GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from .. import _C
from ..util.arguments import is_int, require_int

_ADDRESS_END = 2**63 - 1  # no extent may end past it


def _int64_vector(name: str, values) -> np.ndarray:
    """Ids, checked as every int64 array argument is (kvoffload._C.int64_vector, its
    messages), and copied; ids are small, so an integer array of another dtype or layout,
    or a list, is converted to int64 first."""
    if isinstance(values, np.ma.MaskedArray):  # asarray would drop the mask, keeping masked ids
        raise TypeError(f"{name}: a masked array's masked entries are no ids; pass the ids kept "
                        "(e.g. values.compressed())")
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, RuntimeError):
        array = values  # e.g. a CUDA tensor: the check names what is wrong with it
    if isinstance(array, np.ndarray) and array.dtype == object:
        array = values  # None, or ints past int64: the check names them
    if isinstance(array, np.ndarray):
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        if array.ndim == 1 and array.dtype.kind in "iu" and array.dtype != np.int64:
            if array.dtype == np.uint64 and array.max() > np.iinfo(np.int64).max:
                raise ValueError(f"{name}: does not fit in int64")
            array = array.astype(np.int64)
        elif array.ndim == 1 and array.dtype == np.int64:
            array = np.ascontiguousarray(array)
    return _C.int64_vector(array, name)


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where one tensor's blocks live, in bytes."""

    gpu_base: int
    gpu_stride: int
    page_bytes: int
    cpu_base: int
    cpu_stride: int

    def __post_init__(self):
        require_int("gpu_base", self.gpu_base, 1)
        require_int("cpu_base", self.cpu_base, 1)
        require_int("page_bytes", self.page_bytes, 1)
        require_int("gpu_stride", self.gpu_stride, self.page_bytes)
        require_int("cpu_stride", self.cpu_stride, self.page_bytes)


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    tensors: tuple[TensorLayout, ...]
    num_gpu_blocks: int
    num_cpu_chunks: int

    def __post_init__(self):
        object.__setattr__(self, "tensors", tuple(self.tensors))
        require_int("num_gpu_blocks", self.num_gpu_blocks, 0)
        require_int("num_cpu_chunks", self.num_cpu_chunks, 0)
        if not all(isinstance(t, TensorLayout) for t in self.tensors):
            raise TypeError("tensors: expected TensorLayout entries")

    def column(self, field: str) -> np.ndarray:
        """One field of every tensor, as an int64 column for broadcasting over blocks."""
        return np.array([getattr(t, field) for t in self.tensors], dtype=np.int64)[:, None]


def _overlaps(base, stride, span, count, group):
    """Pairs of regions that share a byte (region k: count[k] spans of span[k] bytes,
    stride[k] apart, from base[k]), as (overlapping pairs, shared pairs): a shared pair is
    one tensor referenced by two groups (same base, stride and count), each with its page."""
    i, j = np.triu_indices(len(base), k=1)
    end = base + (count - 1) * stride + span
    apart = (end[i] <= base[j]) | (end[j] <= base[i])
    gap = (base[j] - base[i]) % np.maximum(stride[i], 1)
    interleaved = (stride[i] == stride[j]) & (gap >= span[i]) & (gap + span[j] <= stride[i])
    touching = ~(apart | interleaved) & (count[i] > 0) & (count[j] > 0)
    shared = ((base[i] == base[j]) & (stride[i] == stride[j]) & (count[i] == count[j])
              & (group[i] != group[j]))
    return np.stack([i, j])[:, touching & ~shared], np.stack([i, j])[:, touching & shared]


def alias_classes(count: int, pairs) -> tuple[int, ...]:
    """The lowest member of each item's class, for classes joined by (a, b) pairs."""
    root = list(range(count))

    def find(k):
        while root[k] != k:
            k = root[k]
        return k

    for a, b in pairs:
        ra, rb = find(a), find(b)
        root[max(ra, rb)] = min(ra, rb)
    return tuple(find(k) for k in range(count))


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Every group of a KV cache and the CPU pool beside it. No two tensors share a byte,
    except that groups may reference one tensor (hybrid models): the same base and stride
    on a side, each reference with its own page. Groups that share a tensor on a side
    alias each other there (``gpu_alias``, ``cpu_alias``: the lowest group of each
    group's class), and a transfer may not name one block or chunk in two of them."""

    groups: tuple[GroupLayout, ...]
    blocks_per_chunk: int
    gpu_alias: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)
    cpu_alias: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        require_int("blocks_per_chunk", self.blocks_per_chunk, 1)
        unshared = tuple(range(len(self.groups)))
        object.__setattr__(self, "gpu_alias", unshared)
        object.__setattr__(self, "cpu_alias", unshared)
        owners = [(g, t) for g, group in enumerate(self.groups) for t in range(len(group.tensors))]
        tensors = [t for group in self.groups for t in group.tensors]
        for g, group in enumerate(self.groups):
            for t, tensor in enumerate(group.tensors):
                if tensor.cpu_stride < self.blocks_per_chunk * tensor.page_bytes:
                    raise ValueError(
                        f"group {g} tensor {t}: cpu_stride {tensor.cpu_stride} cannot hold "
                        f"{self.blocks_per_chunk} pages of {tensor.page_bytes} bytes")
                for side, base, stride, span, count in (
                        ("GPU", tensor.gpu_base, tensor.gpu_stride, tensor.page_bytes, group.num_gpu_blocks),
                        ("CPU", tensor.cpu_base, tensor.cpu_stride, self.blocks_per_chunk * tensor.page_bytes,
                         group.num_cpu_chunks)):
                    # In Python ints: the int64 overlap check below must not wrap.
                    if count and base + (count - 1) * stride + span > _ADDRESS_END:
                        raise ValueError(f"group {g} tensor {t}: its {side} extent ends past 2^63")
        if not tensors:
            return
        column = lambda f: np.array([getattr(t, f) for t in tensors], dtype=np.int64)
        blocks = np.array([g.num_gpu_blocks for g in self.groups for _ in g.tensors], np.int64)
        chunks = np.array([g.num_cpu_chunks for g in self.groups for _ in g.tensors], np.int64)
        group = np.array([g for g, _ in owners], np.int64)
        sides = {
            "GPU": (column("gpu_base"), column("gpu_stride"), column("page_bytes"), blocks),
            "CPU": (column("cpu_base"), column("cpu_stride"),
                    column("page_bytes") * self.blocks_per_chunk, chunks),
        }
        gpu_base, gpu_stride = sides["GPU"][0], sides["GPU"][1]
        for side, regions in sides.items():
            overlapping, shared = _overlaps(*regions, group)
            if overlapping.shape[1]:
                (ga, ta), (gb, tb) = owners[overlapping[0, 0]], owners[overlapping[1, 0]]
                raise ValueError(f"group {ga} tensor {ta} and group {gb} tensor {tb} overlap "
                                 f"on the {side} side")
            # A CPU region is shared only by references to one GPU tensor.
            alone = (gpu_base[shared[0]] != gpu_base[shared[1]]) | (gpu_stride[shared[0]] != gpu_stride[shared[1]])
            if side == "CPU" and alone.any():
                k = int(np.argmax(alone))
                (ga, ta), (gb, tb) = owners[shared[0, k]], owners[shared[1, k]]
                raise ValueError(f"group {ga} tensor {ta} and group {gb} tensor {tb} share their CPU "
                                 "chunks but not their GPU tensor: one would overwrite the other")
            alias = alias_classes(len(self.groups), zip(group[shared[0]], group[shared[1]]))
            object.__setattr__(self, f"{side.lower()}_alias", alias)

    @classmethod
    def from_tensors(cls, gpu: Sequence[Sequence], cpu: Sequence[Sequence], blocks_per_chunk: int,
                     page_bytes: Sequence[int] | None = None) -> "KVLayout":
        """From torch tensors: gpu[g][t] is [num_blocks, ...], cpu[g][t] is [num_chunks, ...].

        A GPU block is one index of dim 0 and must be contiguous; its page is all of it
        unless ``page_bytes[g]`` says fewer bytes. A CPU chunk's first
        ``blocks_per_chunk * page`` bytes must be contiguous.
        """
        if len(gpu) != len(cpu):
            raise ValueError(f"cpu: has {len(cpu)} groups but gpu has {len(gpu)}")
        pages = tensor_pages(gpu, page_bytes, "gpu")
        regions, num_chunks = [], []
        for g, (gpu_tensors, cpu_tensors) in enumerate(zip(gpu, cpu)):
            if len(gpu_tensors) != len(cpu_tensors):
                raise ValueError(f"cpu[{g}]: has {len(cpu_tensors)} tensors but gpu[{g}] has "
                                 f"{len(gpu_tensors)}")
            for t, (b, page) in enumerate(zip(cpu_tensors, pages[g])):
                if block_bytes(b, f"cpu[{g}][{t}]") < blocks_per_chunk * page:
                    raise ValueError(f"cpu[{g}][{t}]: a chunk cannot hold {blocks_per_chunk} "
                                     f"pages of {page} bytes")
            regions.append([(b.data_ptr(), b.stride(0) * b.element_size()) for b in cpu_tensors])
            chunks = {b.shape[0] for b in cpu_tensors}
            if len(chunks) > 1:
                raise ValueError(f"cpu[{g}]: tensors of one group differ in chunk count")
            num_chunks.append(chunks.pop() if chunks else 0)
        return cls.from_parts(gpu, pages, regions, num_chunks, blocks_per_chunk, "gpu")

    @classmethod
    def from_parts(cls, gpu: Sequence[Sequence], pages: Sequence[Sequence[int]],
                   cpu_regions: Sequence[Sequence[tuple[int, int]]], num_chunks: Sequence[int],
                   blocks_per_chunk: int, name: str = "gpu_tensors") -> "KVLayout":
        """From GPU torch tensors (gpu[g][t], blocks along dim 0), their pages, and the
        (base, stride) of each tensor's CPU chunks: what every constructor ends in."""
        groups = []
        for g, tensors in enumerate(gpu):
            blocks = {t.shape[0] for t in tensors}
            if len(blocks) > 1:
                raise ValueError(f"{name}[{g}]: tensors of one group differ in block count")
            for i, t in enumerate(tensors):
                # No memory behind it (torch gives an empty tensor address 0): say which
                # count is 0, not the base address that follows from it.
                if t.data_ptr() == 0:
                    raise ValueError(f"{name}[{g}][{i}]: has {t.shape[0]} blocks ({t.numel()} elements), so no "
                                     "memory; a group's tensors need at least 1 block")
                if cpu_regions[g][i][0] == 0:
                    where = "num_cpu_chunks" if name == "gpu_tensors" else f"cpu[{g}][{i}]"
                    raise ValueError(f"{where}: group {g} has {num_chunks[g]} CPU chunks and the pool no memory; "
                                     "at least 1 chunk is needed")
            groups.append(GroupLayout(
                tuple(TensorLayout(gpu_base=t.data_ptr(), gpu_stride=t.stride(0) * t.element_size(),
                                   page_bytes=pages[g][i], cpu_base=cpu_regions[g][i][0],
                                   cpu_stride=cpu_regions[g][i][1])
                      for i, t in enumerate(tensors)),
                blocks.pop() if blocks else 0, num_chunks[g]))
        return cls(tuple(groups), blocks_per_chunk)


def block_bytes(tensor, name: str) -> int:
    """Bytes per index of dim 0 (a block), which must be contiguous: the geometry
    copy_blocks uses (kvoffload._C.block_geometry)."""
    for d, stride in enumerate(tensor.stride()):
        if stride < 0:
            raise ValueError(f"{name}: has a negative stride ({stride} in dim {d}, a reversed view); "
                             "blocks must run forward")
    return _C.block_geometry(tensor.shape, tensor.stride(), tensor.element_size(), name)[1]


def tensor_pages(gpu: Sequence[Sequence], page_bytes: Sequence | None = None,
                 name: str = "gpu_tensors") -> list[list[int]]:
    """Bytes moved per block of every tensor, [group][tensor]: the whole block (each index
    of dim 0 must be contiguous, page_bytes or not), or ``page_bytes[g]`` (an int for the
    group, or one per tensor), at most that."""
    if page_bytes is not None and (is_int(page_bytes) or not hasattr(page_bytes, "__len__")):
        raise TypeError(f"page_bytes: expected one entry per group (an int or one per tensor), got {page_bytes!r}")
    if page_bytes is not None and len(page_bytes) != len(gpu):
        raise ValueError(f"page_bytes: has {len(page_bytes)} entries for {len(gpu)} groups")
    pages = []
    for g, group in enumerate(gpu):
        blocks = [block_bytes(t, f"{name}[{g}][{i}]") for i, t in enumerate(group)]
        if page_bytes is None:
            pages.append(blocks)
            continue
        given = page_bytes[g]
        if is_int(given):
            given, where = [given] * len(blocks), [f"page_bytes[{g}]"] * len(blocks)
        else:
            if not hasattr(given, "__len__"):
                raise TypeError(f"page_bytes[{g}]: expected an int or one per tensor, got {given!r}")
            given = list(given)
            if len(given) != len(blocks):
                raise ValueError(f"page_bytes[{g}]: has {len(given)} entries for {len(blocks)} tensors")
            where = [f"page_bytes[{g}][{i}]" for i in range(len(blocks))]
        group_pages = [require_int(w, page, 1) for w, page in zip(where, given)]
        for w, page, block in zip(where, group_pages, blocks):
            if page > block:
                raise ValueError(f"{w}: {page} exceeds the {block}-byte GPU block")
        pages.append(group_pages)
    return pages


@dataclasses.dataclass(frozen=True, eq=False)
class GPUSpec:
    """GPU blocks of a transfer: ids concatenated by group, each group's count, and the
    logical index of each group's first block. ``names``: what errors call each field
    (``{"block_ids": "src_spec.block_ids", ...}``), for callers with names of their own.
    A value: equal to a spec of the same ids, hashable, its ids read-only."""

    block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    names: Mapping[str, str] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        name = self.name
        object.__setattr__(self, "block_ids", _int64_vector(name("block_ids"), self.block_ids))
        for field in ("group_sizes", "block_indices"):
            try:
                values = tuple(getattr(self, field))
            except TypeError:
                raise TypeError(f"{name(field)}: expected a sequence of ints, got "
                                f"{type(getattr(self, field)).__name__}") from None
            object.__setattr__(self, field, tuple(require_int(f"{name(field)}[{g}]", n, 0)
                                                  for g, n in enumerate(values)))
        sizes, firsts = self.group_sizes, self.block_indices
        if len(firsts) != len(sizes):
            raise ValueError(f"{name('block_indices')}: has {len(firsts)} entries but "
                             f"{name('group_sizes')} has {len(sizes)}")
        if sum(sizes) != len(self.block_ids):
            raise ValueError(f"{name('group_sizes')}: add up to {sum(sizes)} but "
                             f"{name('block_ids')} has {len(self.block_ids)} ids")
        self.block_ids.setflags(write=False)

    def name(self, field: str) -> str:
        return (self.names or {}).get(field, field)

    def _key(self):
        return self.block_ids.tobytes(), self.group_sizes, self.block_indices

    def __eq__(self, other):
        return self._key() == other._key() if isinstance(other, GPUSpec) else NotImplemented

    def __hash__(self):
        return hash(self._key())


@dataclasses.dataclass(frozen=True, eq=False)
class CPUSpec:
    """CPU chunks of a transfer, concatenated by group. ``names``: as for GPUSpec
    (``{"chunk_ids": "dst_spec.block_ids"}``). A value, as GPUSpec is."""

    chunk_ids: np.ndarray
    names: Mapping[str, str] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "chunk_ids", _int64_vector(self.name("chunk_ids"), self.chunk_ids))
        self.chunk_ids.setflags(write=False)

    def name(self, field: str) -> str:
        return (self.names or {}).get(field, field)

    def __eq__(self, other):
        return self.chunk_ids.tobytes() == other.chunk_ids.tobytes() if isinstance(other, CPUSpec) else NotImplemented

    def __hash__(self):
        return hash(self.chunk_ids.tobytes())


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """Copy i moves sizes[i] bytes between gpu[i] and cpu[i]. Contiguous int64 arrays."""

    gpu: np.ndarray
    cpu: np.ndarray
    sizes: np.ndarray
    total_bytes: int

    @property
    def descriptors(self) -> int:
        return len(self.sizes)

    def store(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, sizes) for GPU -> CPU."""
        return self.gpu, self.cpu, self.sizes

    def load(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, sizes) for CPU -> GPU."""
        return self.cpu, self.gpu, self.sizes


def chunks_used(num_blocks: int, first_index: int, blocks_per_chunk: int) -> int:
    """How many chunks a group of num_blocks blocks starting at first_index touches."""
    if num_blocks == 0:
        return 0
    return -(-(num_blocks + first_index % blocks_per_chunk) // blocks_per_chunk)


def _check_shared(name: str, ids: np.ndarray, counts, alias: tuple[int, ...], side: str) -> None:
    """Groups that share tensors on a side must not name one id twice in a transfer."""
    if len(set(alias)) == len(alias):
        return
    group = np.repeat(np.arange(len(counts)), counts)
    keys = np.asarray(alias, dtype=np.int64)[group] << 40 | ids
    order = np.argsort(keys, kind="stable")
    repeated = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if repeated.size:
        first, k = int(order[repeated[0]]), int(order[repeated[0] + 1])
        raise ValueError(f"group {group[k]}: {name}[{k}] = {ids[k]} is also used by group "
                         f"{group[first]} ({name}[{first}]), which shares its {side} tensors")


def group_chunks(gpu: GPUSpec, blocks_per_chunk: int) -> list[int]:
    """How many chunks each group of a job uses (as many CPU ids as the job must name)."""
    return [chunks_used(n, b, blocks_per_chunk) for n, b in zip(gpu.group_sizes, gpu.block_indices)]


def check_shared(layout: KVLayout, gpu: GPUSpec, cpu: CPUSpec, used: list[int] | None = None) -> None:
    """Refuses a transfer naming one block or chunk in two groups that share tensors.
    used: group_chunks(gpu, layout.blocks_per_chunk), where the caller has it."""
    if used is None:
        used = group_chunks(gpu, layout.blocks_per_chunk)
    _check_shared(gpu.name("block_ids"), gpu.block_ids, gpu.group_sizes, layout.gpu_alias, "GPU")
    _check_shared(cpu.name("chunk_ids"), cpu.chunk_ids, used, layout.cpu_alias, "CPU")
