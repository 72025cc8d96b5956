"""Reusable descriptor arrays: a job's (src, dst, sizes) live in one until the job is done."""

from __future__ import annotations

import collections
import threading

import numpy as np


class DescriptorPool:
    """int64 arrays of shape [3, capacity], capacities powers of two (at least 64).

    In a steady state every acquire is served by an earlier release; ``allocated``
    counts the arrays ever made. Safe from any thread. An array goes back at most once:
    releasing one that is not on loan raises ValueError (two jobs would then share it).
    """

    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        self._lent: dict[int, np.ndarray] = {}  # id -> array on loan
        self._lock = threading.Lock()
        self.allocated = 0

    def acquire(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """An array whose rows start with copies of src, dst and sizes."""
        n = len(sizes)
        capacity = max(64, 1 << max(n - 1, 0).bit_length())
        with self._lock:
            free = self._free[capacity]
            if free:
                array = free.pop()
            else:
                array = np.empty((3, capacity), dtype=np.int64)
                self.allocated += 1
            self._lent[id(array)] = array
        array[0, :n], array[1, :n], array[2, :n] = src, dst, sizes
        return array

    def release(self, array: np.ndarray) -> None:
        with self._lock:
            if self._lent.get(id(array)) is not array:
                raise ValueError("array: is not on loan from this pool (released twice?)")
            del self._lent[id(array)]
            self._free[array.shape[1]].append(array)
