"""Which job of each lane last touched each GPU block and CPU sub-block of a handler.

A lane runs its jobs in submission order, so a new job needs to wait, per other lane,
only for the latest job there that touched the same bytes with one of the two writing.
Stores read GPU blocks and write CPU sub-blocks; loads do the opposite. Tables are
indexed by the flat numbering of PageTable.keys; job numbers start at 1.

A job's keys reach its lane's tables only when another lane asks about that lane while
the job is in flight, or when it retires and its keys must outlive it (first_failed).
Most jobs run while no other lane asks: they are never written, and their submission
costs nothing here."""

from __future__ import annotations

import collections
from typing import Hashable

import numpy as np

from kvoffload import _C

SIDES = ("gpu", "cpu")
_EMPTY = np.zeros(0, dtype=np.int64)


class LazyKeys:
    """A job's (gpu keys, cpu keys), made by ``make()`` on first use and kept."""

    def __init__(self, make):
        self._make, self._keys = make, None

    def __call__(self) -> tuple[np.ndarray, np.ndarray]:
        if self._keys is None:
            self._keys = self._make()
        return self._keys


class LaneAccesses:
    def __init__(self, gpu_keys: int, cpu_keys: int):
        self._sizes = {"gpu": gpu_keys, "cpu": cpu_keys}
        self._tables: dict[tuple[str, str], np.ndarray] = {}  # (lane, side), made on first use
        # Per lane, (seq, keys) of jobs recorded but not yet written, oldest first.
        self._pending: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._noted: dict[str, int] = collections.defaultdict(int)  # per lane, the last seq recorded

    def record(self, lane: str, keys, seq: int) -> None:
        """Job number ``seq`` of ``lane`` touches the keys ``keys()`` returns as (gpu,
        cpu) arrays (a LazyKeys: asked for only when they are written, and kept until
        then). Numbers rise per lane; recording one again is a no-op."""
        if seq > self._noted[lane]:
            self._noted[lane] = seq
            self._pending[lane].append((seq, keys))

    def retire(self, lane: str, seq: int, keep: bool) -> None:
        """Job ``seq`` of ``lane`` and every earlier one of it are done. keep: its keys
        still matter (a later first_failed may ask about them), so they are written;
        else they are dropped (touching never asks about jobs that are done). Again for
        the same job, a no-op."""
        pending = self._pending[lane]
        while pending and pending[0][0] <= seq:
            if keep and pending[0][0] == seq:
                self._write(lane, *pending[0])
            pending.popleft()

    def _flush(self, lane: str) -> None:
        pending = self._pending[lane]
        while pending:
            try:
                self._write(lane, *pending[0])
            except IndexError:
                pending.popleft()  # keys outside the tables: reported once, never written
                raise
            pending.popleft()

    def _write(self, lane: str, seq: int, keys) -> None:
        gpu, cpu = keys()
        # Both sides in one call: an interrupt leaves both written or neither.
        tables = []
        for side in SIDES:
            if (lane, side) not in self._tables:
                self._tables[lane, side] = np.zeros(self._sizes[side], dtype=np.int64)
            tables.append(self._tables[lane, side])
        _C.tables_fill(tables[0], gpu, tables[1], cpu, seq)

    def touching(self, lane: str, side: str, keys: np.ndarray, since: int) -> np.ndarray:
        """The numbers >= since of ``lane``'s jobs that last touched one of these keys,
        distinct and ascending."""
        self._flush(lane)
        table = self._tables.get((lane, side))
        if table is None or len(keys) == 0:
            return _EMPTY
        return _C.table_since(table, keys, since)

    def first_failed(self, lane: str, side: str, keys: np.ndarray,
                     failed: dict[int, Hashable]) -> Hashable | None:
        """The id of a failed job of ``lane`` (``failed``: job number -> id) that was the
        last of its lane to touch one of these keys, or None."""
        if not failed:
            return None
        self._flush(lane)
        table = self._tables.get((lane, side))
        if table is None or len(keys) == 0:
            return None
        seqs = table[keys]
        numbers = np.fromiter(failed, dtype=np.int64, count=len(failed))
        # A lookup table over the failed jobs' numbers: one pass, no sort of seqs.
        kind = "table" if numbers.max() - numbers.min() < (1 << 24) else None
        hit = np.isin(seqs, numbers, kind=kind)
        return failed[int(seqs[np.argmax(hit)])] if hit.any() else None
