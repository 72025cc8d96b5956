"""Random scattered copies over byte pools, and the bytes a destination must then hold."""

from __future__ import annotations

import dataclasses

import numpy as np

POISON = 0xA5


@dataclasses.dataclass(frozen=True)
class Scatter:
    """Copy i moves sizes[i] bytes from src_offsets[i] to dst_offsets[i] of two pools."""

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    sizes: np.ndarray

    def pointers(self, src_base: int, dst_base: int) -> tuple[np.ndarray, np.ndarray]:
        return self.src_offsets + src_base, self.dst_offsets + dst_base

    def expected(self, src_pool: np.ndarray, dst_before: np.ndarray) -> np.ndarray:
        out = dst_before.copy()
        for s, d, n in zip(self.src_offsets, self.dst_offsets, self.sizes):
            out[d : d + n] = src_pool[s : s + n]
        return out


def scatter(rng: np.random.Generator, sizes: np.ndarray, slot: int, pool_bytes: int,
            misalign: bool = False) -> Scatter:
    """Copies of the given sizes at distinct random slots of `slot` bytes in each pool.

    With misalign, each copy starts at a random byte offset inside its slot.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    slots = pool_bytes // slot
    assert len(sizes) <= slots and sizes.max(initial=0) <= slot
    def offsets() -> np.ndarray:
        base = rng.permutation(slots)[: len(sizes)].astype(np.int64) * slot
        if misalign:
            base += rng.integers(0, slot - sizes + 1)
        return base
    return Scatter(offsets(), offsets(), sizes)


def random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def poisoned(n: int) -> np.ndarray:
    return np.full(n, POISON, dtype=np.uint8)
