"""The memory kvoffload may touch: registered regions, and a vectorized check that every
copy lies inside one of the right kind.

The raw-pointer calls (``kv.batch_copy``, ``kernel_copy``, ``staged_copy``, ``host_copy``)
are the unchecked mode: they copy where they are told, after checking only that pointers
are positive and sizes too; callers who want the check call ``MemoryRegistry.check``
first. (The handler's plans stay inside its layout by construction; wiring this check
into the handler and every path is issue 6's work.)
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("device", "host")


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    start: int
    nbytes: int
    kind: str

    @property
    def end(self) -> int:
        return self.start + self.nbytes


class MemoryRegistry:
    def __init__(self):
        self._regions: list[Region] = []
        self._index: dict[str, tuple[np.ndarray, np.ndarray, list[Region]]] = {}

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    def register(self, name: str, start: int, nbytes: int, kind: str) -> None:
        """Adds [start, start + nbytes) as memory of ``kind`` ("device" or "host")."""
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        if start <= 0 or nbytes <= 0:
            raise ValueError(f"{name}: needs a positive address and size, got {start:#x}, {nbytes}")
        region = Region(name, int(start), int(nbytes), kind)
        for other in self._regions:
            if other.kind != kind and region.start < other.end and other.start < region.end:
                raise ValueError(f"{name}: overlaps {other.name}, registered as {other.kind} memory")
        self._regions.append(region)
        self._index.pop(kind, None)

    def register_tensor(self, name: str, tensor) -> None:
        """Adds the bytes a torch tensor spans; CUDA tensors are device memory."""
        span = (max(0, (tensor.shape[0] - 1) * tensor.stride(0)) if tensor.dim() else 0) * tensor.element_size()
        nbytes = span + (tensor[0].numel() * tensor.element_size() if tensor.dim() and len(tensor) else 0)
        self.register(name, tensor.data_ptr(), max(nbytes, 1), "device" if tensor.is_cuda else "host")

    def _merged(self, kind: str):
        """Disjoint intervals covering the regions of ``kind``, sorted, with the regions."""
        if kind not in self._index:
            regions = sorted((r for r in self._regions if r.kind == kind), key=lambda r: r.start)
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
        inside one registered region of ``kind``."""
        addresses = np.asarray(addresses, dtype=np.int64)
        sizes = np.asarray(sizes, dtype=np.int64)
        starts, ends, regions = self._merged(kind)
        at = np.searchsorted(starts, addresses, side="right") - 1
        inside = (at >= 0) & (addresses + sizes <= ends[np.maximum(at, 0)]) if len(starts) else \
            np.zeros(len(addresses), dtype=bool)
        if inside.all():
            return
        i = int(np.argmin(inside))
        a, n = int(addresses[i]), int(sizes[i])
        nearest = min(regions, key=lambda r: min(abs(a - r.start), abs(a - r.end)), default=None)
        missed = (f"nearest {kind} region: {nearest.name} [{nearest.start:#x}, {nearest.end:#x})"
                  if nearest else f"no {kind} region is registered")
        raise ValueError(f"{what}[{i}]: [{a:#x}, {a + n:#x}) is outside registered {kind} memory; {missed}")
