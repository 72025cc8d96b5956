"""Which job of each lane last touched each GPU block and CPU sub-block of a handler.

A lane runs its jobs in submission order, so a new job needs to wait, per other lane,
only for the latest job there that touched the same bytes with one of the two writing.
Stores read GPU blocks and write CPU sub-blocks; loads do the opposite. Tables are
indexed by the flat numbering of PageTable.prepare's keys; job numbers start at 1."""

from __future__ import annotations

from typing import Hashable

import numpy as np

from kvoffload import _C

SIDES = ("gpu", "cpu")
_EMPTY = np.zeros(0, dtype=np.int64)


class LaneAccesses:
    def __init__(self, gpu_keys: int, cpu_keys: int):
        self._sizes = {"gpu": gpu_keys, "cpu": cpu_keys}
        self._tables: dict[tuple[str, str], np.ndarray] = {}  # (lane, side), made on first use

    def record(self, lane: str, gpu: np.ndarray, cpu: np.ndarray, seq: int) -> None:
        """Job number ``seq`` of ``lane`` touches these keys (both sides in one call: an
        interrupt leaves both recorded or neither)."""
        tables = []
        for side in SIDES:
            if (lane, side) not in self._tables:
                self._tables[lane, side] = np.zeros(self._sizes[side], dtype=np.int64)
            tables.append(self._tables[lane, side])
        _C.tables_fill(tables[0], gpu, tables[1], cpu, seq)

    def touching(self, lane: str, side: str, keys: np.ndarray, since: int) -> np.ndarray:
        """The numbers >= since of ``lane``'s jobs that last touched one of these keys,
        distinct and ascending."""
        table = self._tables.get((lane, side))
        if table is None or len(keys) == 0:
            return _EMPTY
        return _C.table_since(table, keys, since)

    def first_failed(self, lane: str, side: str, keys: np.ndarray,
                     failed: dict[int, Hashable]) -> Hashable | None:
        """The id of a failed job of ``lane`` (``failed``: job number -> id) that was the
        last of its lane to touch one of these keys, or None."""
        table = self._tables.get((lane, side))
        if not failed or table is None or len(keys) == 0:
            return None
        seqs = table[keys]
        numbers = np.fromiter(failed, dtype=np.int64, count=len(failed))
        # A lookup table over the failed jobs' numbers: one pass, no sort of seqs.
        kind = "table" if numbers.max() - numbers.min() < (1 << 24) else None
        hit = np.isin(seqs, numbers, kind=kind)
        return failed[int(seqs[np.argmax(hit)])] if hit.any() else None
