"""Which job of each lane last touched each GPU block and CPU sub-block of a handler.

A lane runs its jobs in submission order, so a new job needs to wait, per other lane,
only for the latest job there that touched the same bytes with one of the two writing.
Stores read GPU blocks and write CPU sub-blocks; loads do the opposite. Tables are
indexed by the flat numbering of PageTable.keys; job numbers start at 1.

A job's keys reach its lane's tables only when another lane asks about that lane while
the job is in flight, or when it retires and its keys must outlive it (first_failed).
Most jobs run while no other lane asks: they are never written, and their submission
costs nothing here.

A job that failed (fail()) is remembered from its retirement on, for first_failed, until
later jobs of its lane have written again every key it wrote; until then every job of
its lane that retires is written, and once none is left, writing stops again. Beside
the table of the side they wrote, another names the remembered failure that last wrote
each key (or 0), and each failure counts the keys it still holds: a write costs the same
however many failures are remembered."""

from __future__ import annotations

import collections
from typing import Hashable

import numpy as np

from .. import _C

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
        # Per lane, [seq, keys, written] of the jobs recorded and not retired, oldest first;
        # written: False, True, or None for keys outside the tables (never written).
        self._jobs: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._noted: dict[str, int] = collections.defaultdict(int)  # per lane, the last seq recorded
        # Per lane, seq -> (what, side written) of failed jobs not yet retired.
        self._failing: dict[str, dict] = collections.defaultdict(dict)
        # Per lane, seq -> [what, side written, how many keys of it they still touched last]
        # of the retired failed jobs still last to touch a key of the side they wrote.
        self._failed: dict[str, dict] = collections.defaultdict(dict)
        # (lane, side) -> per key, the failed job of _failed that last touched it, or 0;
        # made on the lane's first failure.
        self._failed_at: dict[tuple[str, str], np.ndarray] = {}
        # (lane, side)s whose counts an interrupt may have left high: recounted at the next write.
        self._recount: set[tuple[str, str]] = set()

    def record(self, lane: str, keys, seq: int) -> None:
        """Job number ``seq`` of ``lane`` touches the keys ``keys()`` returns as (gpu,
        cpu) arrays (a LazyKeys: asked for only when they are written, and kept until
        the job retires). Numbers rise per lane; recording one again is a no-op."""
        if seq > self._noted[lane]:
            jobs = self._jobs[lane]
            if not jobs or jobs[-1][0] != seq:  # (else an interrupt came before _noted was set)
                jobs.append([seq, keys, False])
            self._noted[lane] = seq

    def fail(self, lane: str, seq: int, what: Hashable, wrote: str) -> None:
        """Job ``seq`` of ``lane``, not yet retired, failed partway through writing the
        keys of side ``wrote``: first_failed names ``what`` for those it touched last."""
        self._failing[lane][seq] = (what, wrote)

    def has_failed(self, lane: str) -> bool:
        """Whether first_failed may find a failed job of ``lane``."""
        return bool(self._failed[lane])

    def retire(self, lane: str, seq: int) -> None:
        """Job ``seq`` of ``lane`` and every earlier one of it are done. While the lane
        has failed jobs (this one included), their keys are written, since a later
        first_failed may ask about them; else they are dropped (touching never asks
        about jobs that are done). Again for the same job, a no-op."""
        jobs, failing, failed = self._jobs[lane], self._failing[lane], self._failed[lane]
        while jobs and jobs[0][0] <= seq:
            entry = jobs[0]
            failure = failing.get(entry[0])
            if (failed or failure is not None) and entry[2] is False:
                self._write_entry(lane, entry)
            if failure is not None and entry[2]:  # (a job never written wrote no key last)
                self._remember(lane, entry, *failure)
            jobs.popleft()
            failing.pop(entry[0], None)

    def _remember(self, lane: str, entry: list, what: Hashable, side: str) -> None:
        """Remembers a failed job, written, for the keys of ``side`` it still touched last
        (again after an interrupt: the same)."""
        seq, keys = entry[0], entry[1]()[SIDES.index(side)]
        failed = self._failed[lane]
        last = np.unique(keys[self._tables[lane, side][keys] == seq])
        if last.size or seq in failed:
            if (lane, side) not in self._failed_at:
                self._failed_at[lane, side] = np.zeros(self._sizes[side], dtype=np.int64)
            failed_at = self._failed_at[lane, side]
            failed[seq] = [what, side, len(keys) + 1]  # (before a key names it; high until counted)
            failed_at[last] = seq
            # Counted from failed_at, not from last: a repeat after an interrupt may find keys
            # a later write took in the tables, not yet in failed_at.
            named = int(np.count_nonzero(failed_at[np.unique(keys)] == seq))
            if named:
                failed[seq][2] = named
            else:
                del failed[seq]

    def _rewritten(self, lane: str, side: str, keys: np.ndarray) -> None:
        """A later job of ``lane`` wrote these keys (in range): the failed jobs that last
        touched them no longer do, and those left with no key are forgotten."""
        failed_at, failed = self._failed_at.get((lane, side)), self._failed[lane]
        if failed_at is None or not failed:  # (no failure remembered: no key names one)
            return
        if (lane, side) in self._recount:
            seqs, counts = np.unique(failed_at[failed_at != 0], return_counts=True)
            held = dict(zip(seqs.tolist(), counts.tolist()))
            for seq in [s for s, f in failed.items() if f[1] == side]:
                failed[seq][2] = held.get(seq, 0)
                if not failed[seq][2]:
                    del failed[seq]
            self._recount.discard((lane, side))
        taken = np.unique(keys[failed_at[keys] != 0])
        if taken.size:
            seqs, counts = np.unique(failed_at[taken], return_counts=True)
            self._recount.add((lane, side))  # (an interrupt below leaves a count high: recounted)
            failed_at[taken] = 0
            for seq, n in zip(seqs.tolist(), counts.tolist()):
                failed[seq][2] -= n
                if failed[seq][2] <= 0:
                    del failed[seq]
            self._recount.discard((lane, side))

    def _flush(self, lane: str) -> None:
        for entry in self._jobs[lane]:
            if entry[2] is False:
                self._write_entry(lane, entry)

    def _write_entry(self, lane: str, entry: list) -> None:
        try:
            self._write(lane, entry[0], entry[1])
        except IndexError:
            entry[2] = None  # keys outside the tables: reported once, never written
            raise
        entry[2] = True

    def _write(self, lane: str, seq: int, keys) -> None:
        gpu, cpu = keys()
        # Both sides in one call: an interrupt leaves both written or neither.
        tables = []
        for side in SIDES:
            if (lane, side) not in self._tables:
                self._tables[lane, side] = np.zeros(self._sizes[side], dtype=np.int64)
            tables.append(self._tables[lane, side])
        _C.tables_fill(tables[0], gpu, tables[1], cpu, seq)
        # An interrupt here leaves the entry unwritten: it is written again, and this
        # done, before any table is read.
        for side, keys in zip(SIDES, (gpu, cpu)):
            self._rewritten(lane, side, keys)

    def touching(self, lane: str, side: str, keys: np.ndarray, since: int) -> np.ndarray:
        """The numbers >= since of ``lane``'s jobs that last touched one of these keys,
        distinct and ascending."""
        self._flush(lane)
        table = self._tables.get((lane, side))
        if table is None or len(keys) == 0:
            return _EMPTY
        return _C.table_since(table, keys, since)

    def first_failed(self, lane: str, side: str, keys: np.ndarray) -> Hashable | None:
        """What fail() said of a retired failed job of ``lane`` that wrote ``side`` and
        was the last of its lane to touch one of these keys, or None."""
        if not self._failed[lane]:
            return None
        self._flush(lane)
        failed_at = self._failed_at.get((lane, side))
        if failed_at is None or len(keys) == 0:
            return None
        seqs = failed_at[keys]
        hit = np.flatnonzero(seqs)
        return self._failed[lane][int(seqs[hit[0]])][0] if hit.size else None
