"""The memory kvoffload may touch: registered regions, and a vectorized check that every
copy lies inside one of the right kind.

The handler registers its GPU tensors and host pool and checks every job before
submitting it. The raw-pointer calls (``kv.batch_copy``, ``kernel_copy``, ``staged_copy``,
``host_copy``) take ``registry=``: a MemoryRegistry, whose check runs before anything is
copied, or ``UNCHECKED``, the explicit mode for callers who register nothing: those
calls then copy wherever they are told, after checking only that pointers and sizes are
positive and (kernel and staged copies) that the memory is reachable from the GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("device", "host")
ANY = "any"  # a check's kind: either


class Unchecked:
    """The registry argument of the raw-pointer calls that turns their check off."""

    def __repr__(self):
        return "kvoffload.UNCHECKED"


UNCHECKED = Unchecked()


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    start: int
    nbytes: int
    kind: str
    device: int | None = None  # the CUDA device of device memory

    @property
    def end(self) -> int:
        return self.start + self.nbytes


def _int64_array(values, what: str) -> np.ndarray:
    try:
        array = np.asarray(values)
    except (OverflowError, ValueError) as e:
        raise ValueError(f"{what}: not an array of int64 ({e})") from None
    if array.size == 0:
        return np.zeros(0, np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TypeError(f"{what}: expected a 1-D int64 array or a sequence of ints")
    if array.dtype == np.uint64 and (array > np.iinfo(np.int64).max).any():
        raise ValueError(f"{what}: does not fit in int64")
    return array.astype(np.int64, copy=False)


class MemoryRegistry:
    def __init__(self):
        self._regions: list[Region] = []
        self._index: dict[str, tuple[np.ndarray, np.ndarray, list[Region]]] = {}

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    def register(self, name: str, start: int, nbytes: int, kind: str, device: int | None = None) -> None:
        """Adds [start, start + nbytes) as memory of ``kind`` ("device" or "host"; host
        memory that GPU paths copy must be page-locked), on CUDA ``device``."""
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        if start <= 0 or nbytes <= 0:
            raise ValueError(f"{name}: needs a positive address and size, got {start:#x}, {nbytes}")
        region = Region(name, int(start), int(nbytes), kind, device)
        for other in self._regions:
            if other.kind != kind and region.start < other.end and other.start < region.end:
                raise ValueError(f"{name}: overlaps {other.name}, registered as {other.kind} memory")
        self._regions.append(region)
        self._index.clear()

    def register_tensor(self, name: str, tensor) -> None:
        """Adds the bytes a torch tensor spans; CUDA tensors are device memory."""
        span = (max(0, (tensor.shape[0] - 1) * tensor.stride(0)) if tensor.dim() else 0) * tensor.element_size()
        nbytes = span + (tensor[0].numel() * tensor.element_size() if tensor.dim() and len(tensor) else 0)
        self.register(name, tensor.data_ptr(), max(nbytes, 1), "device" if tensor.is_cuda else "host",
                      tensor.device.index if tensor.is_cuda else None)

    def _merged(self, kind: str):
        """Disjoint intervals covering the regions of ``kind``, sorted, with the regions."""
        if kind not in self._index:
            regions = sorted((r for r in self._regions if kind in (ANY, r.kind)), key=lambda r: r.start)
            starts, ends = [], []
            for r in regions:
                if ends and r.start <= ends[-1]:
                    ends[-1] = max(ends[-1], r.end)
                else:
                    starts.append(r.start)
                    ends.append(r.end)
            self._index[kind] = (np.array(starts, np.int64), np.array(ends, np.int64), regions)
        return self._index[kind]

    def check(self, addresses, sizes, kind: str, what: str = "copies") -> None:
        """Raises ValueError naming the first copy whose [address, address + size) is not
        inside one registered region of ``kind`` ("device", "host" or "any")."""
        if kind not in KINDS + (ANY,):
            raise ValueError(f"kind: expected one of {KINDS + (ANY,)}, got {kind!r}")
        addresses, sizes = _int64_array(addresses, what), _int64_array(sizes, "sizes")
        if addresses.shape != sizes.shape:
            raise ValueError(f"{what}: has {len(addresses)} entries but sizes has {len(sizes)}")
        starts, ends, regions = self._merged(kind)
        at = np.searchsorted(starts, addresses, side="right") - 1
        # end - address >= size, not address + size <= end: the sum may overflow int64.
        inside = ((at >= 0) & (sizes > 0) & (ends[np.maximum(at, 0)] - addresses >= sizes)
                  if len(starts) else np.zeros(len(addresses), dtype=bool))
        if inside.all():
            return
        i = int(np.argmin(inside))
        a, n = int(addresses[i]), int(sizes[i])
        nearest = min(regions, key=lambda r: min(abs(a - r.start), abs(a - r.end)), default=None)
        memory = "memory" if kind == ANY else f"{kind} memory"
        missed = (f"nearest region: {nearest.name} [{nearest.start:#x}, {nearest.end:#x})"
                  if nearest else f"no region of {memory} is registered")
        raise ValueError(f"{what}[{i}]: [{a:#x}, {a + n:#x}) is outside registered {memory}; {missed}")

    def check_copies(self, src, dst, sizes, src_kind: str = ANY, dst_kind: str = ANY) -> None:
        """Checks both ends of every copy; the error names ``src[i]`` or ``dst[i]``."""
        self.check(src, sizes, src_kind, "src")
        self.check(dst, sizes, dst_kind, "dst")


def check_copies(registry, src, dst, sizes, src_kind: str = ANY, dst_kind: str = ANY) -> None:
    """``registry.check_copies``, or nothing for UNCHECKED; anything else is a TypeError."""
    if registry is UNCHECKED:
        return
    if not isinstance(registry, MemoryRegistry):
        raise TypeError(f"registry: expected a MemoryRegistry or kvoffload.UNCHECKED, got "
                        f"{type(registry).__name__}")
    registry.check_copies(src, dst, sizes, src_kind, dst_kind)
