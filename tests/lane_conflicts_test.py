"""kvoffload.lane_conflicts against a model that keeps, per lane, the last job in flight
to touch each key; random jobs in random lanes that finish in order at random times."""

import numpy as np
from hypothesis import given, settings, strategies as st

from kvoffload.lane_accesses import SIDES, LazyKeys
from kvoffload.lane_conflicts import LaneConflicts

LANES = {"store": True, "load": False, "expedited": False}  # lane -> writes CPU sub-blocks


class Handle:
    def __init__(self, seq):
        self.seq, self.done = seq, False


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_waits_and_sources_match_a_model(seed):
    rng = np.random.default_rng(seed)
    sizes = {"gpu": int(rng.integers(1, 40)), "cpu": int(rng.integers(1, 40))}
    conflicts = LaneConflicts(sizes["gpu"], sizes["cpu"], done=lambda h: h.done)
    in_flight = {lane: [] for lane in LANES}  # (handle, {side: keys})

    def keys(side):
        return rng.permutation(sizes[side])[: rng.integers(0, sizes[side] + 1)].astype(np.int64)

    for seq in range(1, 60):
        for jobs in in_flight.values():  # a lane's jobs finish oldest first
            while jobs and rng.random() < 0.25:
                jobs.pop(0)[0].done = True
        lane = list(LANES)[rng.integers(len(LANES))]
        writes_cpu = LANES[lane]
        touched = {side: keys(side) for side in SIDES}
        lazy = LazyKeys(lambda t=touched: (t["gpu"], t["cpu"]))

        want_waits, want_sources = [], []
        for other, jobs in in_flight.items():
            if other == lane:
                continue
            latest = None
            for side in SIDES:
                other_writes = (side == "cpu") == LANES[other]
                if not (other_writes or (side == "cpu") == writes_cpu):
                    continue
                last = {}
                for handle, their in jobs:
                    last.update({k: handle for k in their[side].tolist()})
                hit = {last[k] for k in touched[side].tolist() if k in last}
                if hit:
                    newest = max(hit, key=lambda h: h.seq)
                    latest = newest if latest is None or newest.seq > latest.seq else latest
                    if side == "cpu" and other_writes:
                        want_sources += sorted(hit, key=lambda h: h.seq)
            if latest is not None:
                want_waits.append(latest)

        handle = Handle(seq)
        if rng.random() < 0.5:
            waits, sources = conflicts.resolve_and_add(lane, seq, writes_cpu, lazy, handle)
        else:
            waits, sources = conflicts.resolve(lane, writes_cpu, lazy)
            conflicts.add(lane, seq, writes_cpu, lazy, handle)
        if rng.random() < 0.2:
            conflicts.add(lane, seq, writes_cpu, lazy, handle)  # again (after an interrupt): a no-op
        assert sorted(h.seq for h in waits) == sorted(h.seq for h in want_waits)
        assert sorted(h.seq for h in sources) == sorted(h.seq for h in want_sources)
        in_flight[lane].append((handle, touched))


def test_a_job_done_is_never_waited_for_and_its_keys_are_let_go():
    done = set()
    conflicts = LaneConflicts(8, 8, done=lambda h: h in done)
    made = []
    everything = LazyKeys(lambda: (np.arange(8), np.arange(8)))
    for seq in (1, 2):
        keys = LazyKeys(lambda: (made.append(1) or np.arange(8), np.arange(8)))
        conflicts.add("store", seq, True, keys, f"store {seq}")
    assert conflicts.resolve("load", False, everything) == (["store 2"], ["store 2"])
    done.update({"store 1", "store 2"})
    assert conflicts.resolve("load", False, everything) == ([], [])
    conflicts.add("store", 3, True, LazyKeys(lambda: (np.arange(1), np.arange(1))), "store 3")
    assert conflicts.resolve("load", False, everything) == (["store 3"], ["store 3"])
    assert len(made) == 2  # each job's keys were made once, when a load first asked
