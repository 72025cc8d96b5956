"""kvoffload.jobs.conflicts against a model that keeps every job's keys: random jobs in
random lanes that finish in order at random times, some of them failing."""

import numpy as np
from hypothesis import given, settings, strategies as st

from kvoffload.jobs.accesses import SIDES, LazyKeys
from kvoffload.jobs.conflicts import LaneConflicts

LANES = {"store": True, "load": False, "expedited": False}  # lane -> writes CPU sub-blocks


class Handle:
    def __init__(self, seq):
        self.seq, self.done, self.error = seq, False, None


def lazy(gpu, cpu):
    return LazyKeys(lambda: (np.asarray(gpu, np.int64), np.asarray(cpu, np.int64)))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_waits_and_sources_match_a_model(seed):
    rng = np.random.default_rng(seed)
    sizes = {"gpu": int(rng.integers(1, 40)), "cpu": int(rng.integers(1, 40))}
    conflicts = LaneConflicts(sizes["gpu"], sizes["cpu"], done=lambda h: h.done)
    jobs = {lane: [] for lane in LANES}  # every job: (handle, {side: keys}), oldest first
    fails = rng.random() < 0.5

    def keys(side):
        return rng.permutation(sizes[side])[: rng.integers(0, sizes[side] + 1)].astype(np.int64)

    for seq in range(1, 60):
        for lane_jobs in jobs.values():  # a lane's jobs finish oldest first
            for handle, _ in lane_jobs:
                if not handle.done:
                    if rng.random() > 0.25:
                        break
                    handle.done = True
                    if fails and rng.random() < 0.1:
                        handle.error = "broke"
        lane = list(LANES)[rng.integers(len(LANES))]
        writes_cpu = LANES[lane]
        touched = {side: keys(side) for side in SIDES}

        want_waits, want_sources, want_failed = [], [], set()
        for other, their_jobs in jobs.items():
            if other == lane:
                continue
            latest = None
            for side in SIDES:
                other_writes = (side == "cpu") == LANES[other]
                if not (other_writes or (side == "cpu") == writes_cpu):
                    continue
                last = {}
                for handle, their in their_jobs:
                    last.update({k: handle for k in their[side].tolist()})
                hit = {last[k] for k in touched[side].tolist() if k in last}
                busy = {h for h in hit if not h.done}
                if busy:
                    newest = max(busy, key=lambda h: h.seq)
                    latest = newest if latest is None or newest.seq > latest.seq else latest
                    if other_writes and (side == "cpu") != writes_cpu:  # what this job reads
                        want_sources += busy
                if side == "cpu" and other_writes and not writes_cpu:
                    want_failed |= {h for h in hit if h.done and h.error}
            if latest is not None:
                want_waits.append(latest)

        handle = Handle(seq)
        if rng.random() < 0.5:
            waits, sources = conflicts.resolve_and_add(lane, seq, writes_cpu, lazy(touched["gpu"], touched["cpu"]),
                                                       handle)
        else:
            waits, sources = conflicts.resolve(lane, writes_cpu, lazy(touched["gpu"], touched["cpu"]))
            conflicts.add(lane, seq, writes_cpu, lazy(touched["gpu"], touched["cpu"]), handle)
        if rng.random() < 0.2:
            conflicts.add(lane, seq, writes_cpu, lazy([], []), handle)  # again (after an interrupt): a no-op
        assert sorted(h.seq for h in waits) == sorted(h.seq for h in want_waits)
        assert sorted(h.seq for h in sources if not h.done) == sorted(h.seq for h in want_sources)
        failed = [h for h in sources if h.done]
        assert len(failed) == bool(want_failed) and set(failed) <= want_failed  # one is enough
        jobs[lane].append((handle, touched))


def test_a_job_done_is_never_waited_for_and_its_keys_are_let_go():
    conflicts = LaneConflicts(8, 8, done=lambda h: h.done)
    handles = [Handle(seq) for seq in range(4)]
    made = []
    everything = lazy(np.arange(8), np.arange(8))
    for seq in (1, 2):
        keys = LazyKeys(lambda: (made.append(1) or np.arange(8), np.arange(8)))
        conflicts.add("store", seq, True, keys, handles[seq])
    assert conflicts.resolve("load", False, everything) == ([handles[2]], [handles[2]])
    handles[1].done = handles[2].done = True
    assert conflicts.resolve("load", False, everything) == ([], [])
    conflicts.add("store", 3, True, lazy(np.arange(1), np.arange(1)), handles[3])
    assert conflicts.resolve("load", False, everything) == ([handles[3]], [handles[3]])
    assert len(made) == 2  # each job's keys were made once, when a load first asked


def test_a_failed_store_done_before_a_load_asks_is_still_its_source():
    conflicts = LaneConflicts(8, 8, done=lambda h: h.done)
    store, later = Handle(1), Handle(2)
    conflicts.add("store", 1, True, lazy(np.arange(4), np.arange(4)), store)
    store.done, store.error = True, "RuntimeError: out of memory"
    assert conflicts.resolve("load", False, lazy([7], [2])) == ([], [store])
    assert conflicts.resolve("load", False, lazy([7], [5])) == ([], [])
    conflicts.add("store", 2, True, lazy([], [2]), later)  # rewrites sub-block 2
    later.done = True
    assert conflicts.resolve("load", False, lazy([7], [2])) == ([], [])
    assert conflicts.resolve("load", False, lazy([7], [1, 2])) == ([], [store])


def test_a_failed_store_is_named_whatever_its_job_id_even_none():
    for job_id in (None, 0, "s", ("t", 1)):
        conflicts = LaneConflicts(8, 8, done=lambda h: h.done)
        stored = lazy([1, 2], [3, 4])
        conflicts.submitted("store", 1, stored)
        conflicts.collected("store", 1, job_id, True, True)
        assert conflicts.failed_store("store", lazy([5], [4])) == (job_id,)
        assert conflicts.failed_store("store", lazy([5], [6])) is None
        # A later store that rewrites the sub-blocks clears them.
        conflicts.submitted("store", 2, lazy([1, 2], [3, 4]))
        conflicts.collected("store", 2, "again", False, True)
        assert conflicts.failed_store("store", lazy([5], [4])) is None
