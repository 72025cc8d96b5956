"""Which jobs of other lanes a new job must wait for, which stores it reads from, and
which failed stores left the CPU sub-blocks it reads partial: the handler's one record
of who touched what, kept on two clocks.

One thread asks at a time, in submission order, and adds each job before the next one
asks: the handler under its lock, or, for page jobs on CUDA lanes, the enqueue thread
of the job's lane just before it enqueues the job (the lanes' threads take turns in
submission order), so that the caller's submit pays nothing for it. A job counts as in flight until ``done(handle)`` says otherwise; a handle's
``error`` is None unless the job failed.

The handler's own clock (``submitted``, ``collected``, ``failed_store``), under its lock:
the jobs as it submits and collects them, failures by job id, so that a load of chunks a
failed store left partial fails at once, naming that store. It is a second LaneAccesses,
not the lanes': those are written on the enqueue threads, by handle, and a failure
reaches them when a lane's job is found done, not when the handler reports it."""

from __future__ import annotations

import collections
from typing import Hashable

from .accesses import SIDES, LaneAccesses


class LaneConflicts:
    def __init__(self, gpu_keys: int, cpu_keys: int, done):
        self._accesses = LaneAccesses(gpu_keys, cpu_keys)
        self._reported = LaneAccesses(gpu_keys, cpu_keys)  # the handler's clock
        self._done = done
        # Per lane, seq -> handle of its jobs in flight, oldest first; a lane's jobs all
        # write the same side.
        self._jobs: dict[str, collections.OrderedDict] = collections.defaultdict(collections.OrderedDict)
        self._writes_cpu: dict[str, bool] = {}
        self._added: dict[str, int] = collections.defaultdict(int)  # per lane, the last seq added

    def resolve(self, lane: str, writes_cpu: bool, keys) -> tuple[list, list]:
        """(waits, sources) of a job of ``lane`` that touches ``keys()`` (gpu, cpu): per
        other lane, the handle of its latest job in flight that touches the same bytes
        where either writes them; and the handles of the jobs that write what this job
        reads: for a load, the stores that last wrote its CPU sub-blocks, in flight or
        failed; for a store, the loads in flight into its GPU blocks."""
        waits, sources = [], []
        for other, jobs in self._jobs.items():
            if other == lane:
                continue
            in_flight = self._prune(other)
            # What a failed job left partial stays so until a later job of its lane writes it.
            if not writes_cpu and self._accesses.has_failed(other):
                hit = self._accesses.first_failed(other, "cpu", keys()[1])
                if hit is not None:
                    sources.append(hit)
            if not in_flight:
                continue
            latest = 0
            for side in SIDES:
                other_writes = (side == "cpu") == self._writes_cpu[other]
                if not (other_writes or (side == "cpu") == writes_cpu):
                    continue
                seqs = self._accesses.touching(other, side, keys()[SIDES.index(side)], next(iter(jobs)))
                if seqs.size:
                    latest = max(latest, int(seqs[-1]))
                    # What the job reads, in flight in another lane: a load reads the
                    # chunks a store writes, a store the blocks a load writes; it fails
                    # if they do.
                    if other_writes and (side == "cpu") != writes_cpu:
                        sources += [jobs[int(s)] for s in seqs]
            if latest:
                waits.append(jobs[latest])
        return waits, sources

    def add(self, lane: str, seq: int, writes_cpu: bool, keys, handle) -> None:
        """Job ``seq`` of ``lane`` is in flight. Numbers rise per lane; adding one again
        is a no-op."""
        self._prune(lane)
        jobs = self._jobs[lane]
        if seq <= self._added[lane] or seq in jobs:
            return  # (the second: an interrupt came before _added was set)
        self._writes_cpu[lane] = writes_cpu
        self._accesses.record(lane, keys, seq)
        jobs[seq] = handle
        self._added[lane] = seq

    def resolve_and_add(self, lane: str, seq: int, writes_cpu: bool, keys, handle) -> tuple[list, list]:
        """resolve(), then add()."""
        got = self.resolve(lane, writes_cpu, keys)
        self.add(lane, seq, writes_cpu, keys, handle)
        return got

    def submitted(self, lane: str, seq: int, keys) -> None:
        """The handler submitted job ``seq`` of ``lane``; again, a no-op."""
        self._reported.record(lane, keys, seq)

    def collected(self, lane: str, seq: int, job_id: Hashable, failed: bool, writes_cpu: bool) -> None:
        """The handler collected job ``seq`` (``job_id``) of ``lane``. Again after an
        interrupt, the same."""
        if failed and writes_cpu:
            self._reported.fail(lane, seq, (job_id,), "cpu")
        self._reported.retire(lane, seq)

    def failed_store(self, store_lane: str, keys) -> tuple[Hashable] | None:
        """(job id,) of a collected failed store that last wrote one of the CPU
        sub-blocks ``keys()[1]`` names (any id, None too), or None."""
        if not self._reported.has_failed(store_lane):
            return None
        return self._reported.first_failed(store_lane, "cpu", keys()[1])

    def _prune(self, lane: str) -> int:
        """Forgets the lane's jobs that are done (they finish in order), but for the
        failures of a lane that writes CPU sub-blocks (LaneAccesses keeps those); how
        many are left in flight."""
        jobs = self._jobs[lane]
        while jobs:
            seq, handle = next(iter(jobs.items()))
            if not self._done(handle):
                break
            if self._writes_cpu[lane] and handle.error is not None:
                self._accesses.fail(lane, seq, handle, "cpu")
            self._accesses.retire(lane, seq)  # each step may be repeated after an interrupt
            jobs.pop(seq, None)
        return len(jobs)
