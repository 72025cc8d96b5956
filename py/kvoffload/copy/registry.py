"""The memory kvoffload may touch: registered regions, and a vectorized check that every
copy lies inside one of the right kind.

The handler registers its GPU tensors and host pool and checks every job before
submitting it. The raw-pointer calls (``kv.batch_copy``, ``kernel_copy``, ``staged_copy``,
``host_copy``) take ``registry=``: a MemoryRegistry, whose check runs before anything is
copied, or ``UNCHECKED``, the explicit mode for callers who register nothing: those
calls then copy wherever they are told, after checking only that pointers and sizes are
positive and (kernel and staged copies) that the memory is reachable from the GPU.

A tensor registered with ``register_tensor`` is kept alive until ``unregister``, with
its storage. It is also watched: every check first makes sure that each watched tensor
still has the data pointer, shape and strides it was registered with, and its storage
the address and size, and refuses, naming it, a tensor whose memory was swapped or freed
since (``set_()``, ``resize_()`` of it or of its storage, ``.data = ...``), whose old
memory copies would otherwise still reach. A region registered by address
(``register``) is the caller's promise that the memory stays allocated until it is
unregistered; ``watch`` adds a tensor to check, such as one the region lies in.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import _C
from ..util.arguments import require_int
from ..util.vocabulary import MemoryKind
from .writable import is_writable


class Unchecked:
    """The registry argument of the raw-pointer calls that turns their check off."""

    def __repr__(self):
        return "kvoffload.UNCHECKED"


UNCHECKED = Unchecked()


_END = 2**63 - 1  # every region ends at or below it: its end stays an int64


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    start: int
    nbytes: int
    kind: MemoryKind
    device: int | None = None  # the CUDA device of device memory
    owner: object = dataclasses.field(default=None, repr=False, compare=False)  # kept alive
    writable: bool = True  # host memory in read-only mappings may be read, never written

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def _int64_array(values, name: str) -> np.ndarray:
    """values as a 1-D int64 array: itself when it is one (C-contiguous; the raw-pointer
    calls' own copies are), else a validated copy (kvoffload._C.int64_vector)."""
    if (type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1
            and values.flags.c_contiguous):
        return values
    return _C.int64_vector(values, name)


def tensor_span(tensor) -> tuple[int, int]:
    """(address, bytes) of the memory a torch tensor's elements lie in: from its first
    element to its last, whatever its strides (expanded, transposed, sliced)."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    if any(stride < 0 for stride in tensor.stride()):
        raise ValueError("has a negative stride")
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), (last + 1) * tensor.element_size()


@dataclasses.dataclass(frozen=True)
class _Watched:
    """A tensor as it was registered, with its storage held (see the module's doc)."""

    name: str
    tensor: object
    storage: object
    data_ptr: int
    shape: tuple
    stride: tuple
    storage_ptr: int
    storage_nbytes: int

    @classmethod
    def of(cls, name: str, tensor) -> "_Watched":
        storage = tensor.untyped_storage()
        return cls(name, tensor, storage, tensor.data_ptr(), tensor.shape, tensor.stride(),
                   storage.data_ptr(), storage.nbytes())

    def changed(self) -> bool:
        # Holding the storage does not pin its memory: resize_() reallocates it in place, and
        # a tensor set_() onto new memory at the freed address keeps its data_ptr.
        t, s = self.tensor, self.storage
        return (t.data_ptr() != self.data_ptr or t.shape != self.shape or t.stride() != self.stride
                or s.data_ptr() != self.storage_ptr or s.nbytes() != self.storage_nbytes)

    def error(self) -> ValueError:
        t = self.tensor
        return ValueError(
            f"{self.name}: its memory changed since it was registered (data_ptr {self.data_ptr:#x}, shape "
            f"{tuple(self.shape)}, strides {self.stride} -> {t.data_ptr():#x}, {tuple(t.shape)}, {t.stride()}): "
            "set_(), resize_() or .data = ... swapped its storage; nothing copied (register it again)")


class MemoryRegistry:
    """Regions of host and device memory, each a name, an address range and a kind.

    Safe to read from several threads; register and unregister from one at a time.
    """

    def __init__(self):
        self._regions: list[Region] = []
        self._index: dict[MemoryKind | None, tuple[np.ndarray, np.ndarray, list[Region]]] = {}
        self._watched: tuple[_Watched, ...] = ()

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    def overlapping(self, start: int, nbytes: int) -> list[Region]:
        """The regions that share a byte with [start, start + nbytes)."""
        return [r for r in self._regions if r.overlaps(start, start + nbytes)]

    def register(self, name: str, start: int, nbytes: int, kind: MemoryKind | str,
                 device: int | None = None, *, owner=None) -> None:
        """Adds [start, start + nbytes) as memory of ``kind`` (a MemoryKind, or "device" or
        "host"; host memory that GPU paths copy must be page-locked), on CUDA ``device``.
        The memory must stay allocated until ``unregister(name)``; ``owner`` is kept alive
        until then."""
        kind = MemoryKind.parse(kind, "kind")
        start, nbytes = require_int("start", start), require_int("nbytes", nbytes)
        if start <= 0 or nbytes <= 0:
            raise ValueError(f"{name}: needs a positive address and size, got {start:#x}, {nbytes}")
        if nbytes > _END - start:
            raise ValueError(f"{name}: [{start:#x}, {start + nbytes:#x}) ends past 2^63 - 1")
        if any(r.name == name for r in self._regions):
            raise ValueError(f"{name}: is already registered")
        for other in self.overlapping(start, nbytes):
            if (other.kind, other.device) != (kind, device):
                where = f"{other.kind} memory" + (f" of device {other.device}" if other.device is not None else "")
                raise ValueError(f"{name}: overlaps {other.name}, registered as {where}")
        writable = kind != MemoryKind.HOST or is_writable(start, nbytes)
        self._regions = self._regions + [Region(name, start, nbytes, kind, device, owner, writable)]
        self._index = {}

    def register_tensor(self, name: str, tensor) -> None:
        """Adds the bytes a torch tensor's elements span (CUDA tensors are device memory)
        and keeps the tensor, so its memory, alive until ``unregister(name)``."""
        try:
            start, nbytes = tensor_span(tensor)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if nbytes == 0:
            raise ValueError(f"{name}: has no elements")
        self.register(name, start, nbytes, MemoryKind.DEVICE if tensor.is_cuda else MemoryKind.HOST,
                      tensor.device.index if tensor.is_cuda else None, owner=tensor)
        self.watch(name, tensor)

    def watch(self, name: str, tensor) -> None:
        """Holds the tensor and its storage and, before every check, refuses it changed
        (see the module's doc), until ``unregister(name)``."""
        if any(w.name == name for w in self._watched):
            raise ValueError(f"{name}: is already watched")
        self._watched = self._watched + (_Watched.of(name, tensor),)

    def check_tensors(self) -> None:
        """Raises ValueError naming the first watched tensor whose memory changed."""
        for w in self._watched:
            if w.changed():
                raise w.error()

    def unregister(self, name: str) -> None:
        """Removes the region ``name`` (and lets go of its tensor); later copies into it
        are refused."""
        if not any(r.name == name for r in self._regions) and not any(w.name == name for w in self._watched):
            raise KeyError(f"name: no region {name!r} is registered")
        self._regions = [r for r in self._regions if r.name != name]
        self._watched = tuple(w for w in self._watched if w.name != name)
        self._index = {}

    def _merged(self, kind: MemoryKind | None):
        """Disjoint intervals covering the regions of ``kind``, sorted, with the regions.
        Only regions of one kind and device merge: no interval spans two kinds."""
        index = self._index
        if kind not in index:
            regions = sorted((r for r in self._regions if kind in (None, r.kind)), key=lambda r: r.start)
            starts, ends, keys = [], [], []
            for r in regions:
                if ends and r.start <= ends[-1] and keys[-1] == (r.kind, r.device):
                    ends[-1] = max(ends[-1], r.end)
                else:
                    starts.append(r.start)
                    ends.append(r.end)
                    keys.append((r.kind, r.device))
            index[kind] = (np.array(starts, np.int64), np.array(ends, np.int64), regions)
        return index[kind]

    def check(self, addresses, sizes, kind: MemoryKind | str | None, what: str = "copies") -> None:
        """Raises ValueError naming the first copy whose [address, address + size) is not
        inside registered memory of ``kind`` (a MemoryKind, "device" or "host"; None: either),
        or naming a watched tensor whose memory changed. Regions of one kind and device that
        touch or overlap are one run of memory: a copy may span them."""
        self.check_tensors()
        self._check(addresses, sizes, kind, what)

    def _check(self, addresses, sizes, kind, what: str) -> None:
        if kind is not None:
            try:
                kind = MemoryKind.parse(kind, "kind")
            except ValueError as e:
                raise ValueError(f"{e} (None: either)") from None
        addresses, sizes = _int64_array(addresses, what), _int64_array(sizes, "sizes")
        if addresses.shape != sizes.shape:
            raise ValueError(f"{what}: has {len(addresses)} entries but sizes has {len(sizes)}")
        starts, ends, regions = self._merged(kind)
        i, a, n = _C.first_copy_outside(starts, ends, addresses, sizes)
        if i < 0:
            return
        nearest = min(regions, key=lambda r: min(abs(a - r.start), abs(a - r.end)), default=None)
        memory = "memory" if kind is None else f"{kind} memory"
        missed = (f"nearest region: {nearest.name} [{nearest.start:#x}, {nearest.end:#x})"
                  if nearest else f"no region of {memory} is registered")
        raise ValueError(f"{what}[{i}]: [{a:#x}, {a + n:#x}) is outside registered {memory}; {missed}")

    def check_copies(self, src, dst, sizes, src_kind: MemoryKind | str | None = None,
                     dst_kind: MemoryKind | str | None = None) -> None:
        """Checks both ends of every copy; the error names ``src[i]`` or ``dst[i]``. No
        destination may lie in read-only memory: the copy would fault."""
        self.check_tensors()
        self._check(src, sizes, src_kind, "src")
        self._check(dst, sizes, dst_kind, "dst")
        read_only = [r for r in self._regions if not r.writable]
        if not read_only:
            return
        dst, sizes = _int64_array(dst, "dst"), _int64_array(sizes, "sizes")
        hits = [(int(hit[0]), r) for r in read_only
                if (hit := np.flatnonzero((dst < r.end) & (dst + sizes > r.start))).size]
        if hits:
            i, r = min(hits, key=lambda h: h[0])
            raise ValueError(f"dst[{i}]: [{int(dst[i]):#x}, {int(dst[i] + sizes[i]):#x}) lies in {r.name}, "
                             "read-only memory; a copy writing it would fault")


def require_registry(registry) -> MemoryRegistry | None:
    """The registry of a raw-pointer call, or None for UNCHECKED; anything else is a
    TypeError."""
    if registry is UNCHECKED:
        return None
    if not isinstance(registry, MemoryRegistry):
        raise TypeError(f"registry: expected a MemoryRegistry or kvoffload.UNCHECKED, got "
                        f"{type(registry).__name__}")
    return registry
