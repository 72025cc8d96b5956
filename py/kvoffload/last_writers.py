"""Which store last wrote each CPU sub-block of a handler's pool, in one array: a load
asks about all of its sub-blocks in a few vectorized passes, not one lookup each."""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

_INDEX_BITS = 40  # a key is (group << 40) | chunk id * blocks_per_chunk + sub-block


class LastWriters:
    """slots[g]: sub-blocks of group g (chunks times blocks per chunk)."""

    def __init__(self, slots: Sequence[int]):
        self._offset = np.concatenate(([0], np.cumsum(slots, dtype=np.int64)))[:-1]
        self._seq = np.zeros(int(sum(slots)), dtype=np.int64)  # 0: never written

    def _index(self, keys: np.ndarray) -> np.ndarray:
        return self._offset[keys >> _INDEX_BITS] + (keys & ((1 << _INDEX_BITS) - 1))

    def record(self, keys: np.ndarray, seq: int) -> None:
        """Store number ``seq`` (>= 1) writes these sub-blocks."""
        self._seq[self._index(keys)] = seq

    def first_failed(self, keys: np.ndarray, failed: dict[int, Hashable]) -> Hashable | None:
        """The id of a failed store (``failed``: store number -> job id) that was the last
        to write one of these sub-blocks, or None."""
        if not failed or len(keys) == 0:
            return None
        seqs = self._seq[self._index(keys)]
        numbers = np.fromiter(failed, dtype=np.int64, count=len(failed))
        # A lookup table over the failed stores' numbers: one pass, no sort of seqs.
        kind = "table" if numbers.max() - numbers.min() < (1 << 24) else None
        hit = np.isin(seqs, numbers, kind=kind)
        return failed[int(seqs[np.argmax(hit)])] if hit.any() else None
