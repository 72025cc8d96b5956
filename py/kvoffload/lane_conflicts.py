"""Which jobs of other lanes a new job must wait for, and which stores it reads from.

One thread asks at a time, in submission order, and adds each job before the next one
asks: the handler under its lock, or, for page jobs on CUDA lanes, the lanes' enqueue
thread just before it enqueues the job, so that the caller's submit pays nothing for
it. A job counts as in flight until ``done(handle)`` says otherwise."""

from __future__ import annotations

import collections

from kvoffload.lane_accesses import SIDES, LaneAccesses


class LaneConflicts:
    def __init__(self, gpu_keys: int, cpu_keys: int, done):
        self._accesses = LaneAccesses(gpu_keys, cpu_keys)
        self._done = done
        # Per lane, (seq, handle) of its jobs in flight, oldest first; a lane's jobs all
        # write the same side.
        self._jobs: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._writes_cpu: dict[str, bool] = {}
        self._added: dict[str, int] = collections.defaultdict(int)  # per lane, the last seq added

    def resolve(self, lane: str, writes_cpu: bool, keys) -> tuple[list, list]:
        """(waits, sources) of a job of ``lane`` that touches ``keys()`` (gpu, cpu): per
        other lane, the handle of its latest job in flight that touches the same bytes
        where either writes them; and the handles of the stores in flight that last
        wrote the CPU sub-blocks this job reads."""
        waits, sources = [], []
        for other, jobs in self._jobs.items():
            if other == lane or not self._prune(other):
                continue
            handles = dict(jobs)
            latest = 0
            for side in SIDES:
                other_writes = (side == "cpu") == self._writes_cpu[other]
                if not (other_writes or (side == "cpu") == writes_cpu):
                    continue
                seqs = self._accesses.touching(other, side, keys()[SIDES.index(side)], jobs[0][0])
                if seqs.size:
                    latest = max(latest, int(seqs[-1]))
                    if side == "cpu" and other_writes:
                        sources += [handles[int(s)] for s in seqs]
            if latest:
                waits.append(handles[latest])
        return waits, sources

    def add(self, lane: str, seq: int, writes_cpu: bool, keys, handle) -> None:
        """Job ``seq`` of ``lane`` is in flight. Numbers rise per lane; adding one again
        is a no-op."""
        self._prune(lane)
        jobs = self._jobs[lane]
        if seq <= self._added[lane] or (jobs and jobs[-1][0] >= seq):
            return  # (the second: an interrupt came before _added was set)
        self._writes_cpu[lane] = writes_cpu
        self._accesses.record(lane, keys, seq)
        jobs.append((seq, handle))
        self._added[lane] = seq

    def resolve_and_add(self, lane: str, seq: int, writes_cpu: bool, keys, handle) -> tuple[list, list]:
        """resolve(), then add()."""
        got = self.resolve(lane, writes_cpu, keys)
        self.add(lane, seq, writes_cpu, keys, handle)
        return got

    def _prune(self, lane: str) -> int:
        """Forgets the lane's jobs that are done (they finish in order); how many are left."""
        jobs = self._jobs[lane]
        while jobs and self._done(jobs[0][1]):
            self._accesses.retire(lane, jobs.popleft()[0], keep=False)
        return len(jobs)
