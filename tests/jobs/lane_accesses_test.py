"""kvoffload.jobs.accesses against a dict model, on random jobs in random lanes."""

import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvoffload import _C
from kvoffload.jobs.accesses import SIDES, LaneAccesses, LazyKeys

LANES = ("store", "load", "expedited")


def keys_of(gpu, cpu):
    return LazyKeys(lambda: (np.asarray(gpu, np.int64), np.asarray(cpu, np.int64)))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_touching_and_first_failed_match_a_dict_model(seed):
    # As the handler uses them: a lane's jobs retire oldest first, and a job's failure is
    # known when it retires. The model keeps every job's keys; a failed job counts for
    # as long as it is the last of its lane to touch a key of the side it wrote.
    rng = np.random.default_rng(seed)
    sizes = {"gpu": int(rng.integers(1, 60)), "cpu": int(rng.integers(1, 60))}
    accesses, model, failed = LaneAccesses(sizes["gpu"], sizes["cpu"]), {}, {}
    in_flight = {lane: [] for lane in LANES}
    wrote = {lane: SIDES[i % 2] for i, lane in enumerate(LANES)}

    def keys(side):
        return rng.permutation(sizes[side])[: rng.integers(0, sizes[side] + 1)].astype(np.int64)

    for seq in range(1, 40):
        lane = LANES[rng.integers(len(LANES))]
        touched = {side: keys(side) for side in SIDES}
        accesses.record(lane, keys_of(touched["gpu"], touched["cpu"]), seq)
        if rng.random() < 0.2:
            accesses.record(lane, keys_of(touched["gpu"][:1], touched["cpu"][:1]), seq)  # again: a no-op
        in_flight[lane].append(seq)
        for side in SIDES:
            model.update({(lane, side, k): seq for k in touched[side].tolist()})
        for lane in LANES:
            while in_flight[lane] and rng.random() < 0.3:
                done = in_flight[lane].pop(0)
                if rng.random() < 0.15:
                    failed[done] = f"job {done}"
                    accesses.fail(lane, done, failed[done], wrote[lane])
                accesses.retire(lane, done)
                if rng.random() < 0.1:
                    accesses.retire(lane, done)  # again (after an interrupt): a no-op
        lane, side = LANES[rng.integers(len(LANES))], SIDES[rng.integers(2)]
        oldest = in_flight[lane][0] if in_flight[lane] else seq + 1
        asked, since = keys(side), int(rng.integers(oldest, seq + 2))
        last = [model.get((lane, side, k), 0) for k in asked.tolist()]
        want = sorted({s for s in last if s >= since})
        assert accesses.touching(lane, side, asked, since).tolist() == want
        retired = lambda s: not in_flight[lane] or s < in_flight[lane][0]
        failed_last = {failed[s] for s in last if s in failed and retired(s)} if side == wrote[lane] else set()
        got = accesses.first_failed(lane, side, asked)
        assert (got in failed_last) if failed_last else got is None
        if failed_last:
            assert accesses.has_failed(lane)
    for lane in LANES:  # once every job is done, remembered exactly when still last
        if in_flight[lane]:
            accesses.retire(lane, in_flight[lane][-1])
        still = {s for (ln, sd, _), s in model.items() if ln == lane and sd == wrote[lane] and s in failed}
        assert accesses.has_failed(lane) == bool(still)


def test_jobs_are_written_only_when_another_lane_asks_or_a_failure_is_remembered():
    accesses = LaneAccesses(8, 8)
    accesses.record("store", keys_of(np.arange(4), np.arange(4)), 1)
    accesses.retire("store", 1)  # done before anyone asked: never written
    accesses.record("store", keys_of(np.arange(2), np.arange(2)), 2)
    assert accesses.touching("store", "gpu", np.arange(8), 1).tolist() == [2]
    accesses.retire("store", 2)
    accesses.record("store", keys_of(np.arange(2, 6), np.arange(2, 6)), 3)
    accesses.fail("store", 3, "c", "cpu")
    assert accesses.first_failed("store", "cpu", np.arange(8)) is None  # not retired yet
    accesses.retire("store", 3)
    accesses.retire("store", 3)  # again: a no-op
    assert accesses.touching("store", "gpu", np.arange(8), 1).tolist() == [2, 3]
    assert accesses.first_failed("store", "cpu", np.arange(8)) == "c"
    assert accesses.first_failed("store", "gpu", np.arange(8)) is None  # it wrote CPU sub-blocks


def test_a_failure_is_forgotten_once_its_lane_wrote_everything_it_wrote_again():
    made = []
    accesses = LaneAccesses(8, 8)

    def record(seq, cpu, failed=False):
        accesses.record("store", LazyKeys(lambda: made.append(seq) or (np.arange(8), np.asarray(cpu))), seq)
        if failed:
            accesses.fail("store", seq, f"job {seq}", "cpu")
        accesses.retire("store", seq)

    record(1, [0, 1, 2, 3], failed=True)
    record(2, [0, 1])  # rewrites half
    assert accesses.has_failed("store") and accesses.first_failed("store", "cpu", np.arange(2)) is None
    assert accesses.first_failed("store", "cpu", np.arange(3)) == "job 1"
    record(3, [2, 3, 4], failed=True)  # rewrites the rest, failing too
    assert accesses.first_failed("store", "cpu", np.arange(2, 4)) == "job 3"
    assert accesses.first_failed("store", "cpu", np.arange(2)) is None
    record(4, [2, 3, 4, 5])
    assert not accesses.has_failed("store") and accesses.first_failed("store", "cpu", np.arange(8)) is None
    assert made == [1, 2, 3, 4]
    record(5, [0])  # nothing failed is remembered: not written
    assert made == [1, 2, 3, 4]


def test_a_failure_rewritten_by_a_job_in_flight_is_forgotten_when_the_next_job_retires():
    # The job in flight is in the table once someone asked; a load of those keys waits
    # for it as the latest writer, and fails with it if it fails.
    accesses = LaneAccesses(8, 8)
    accesses.record("store", keys_of([], [0, 1]), 1)
    accesses.record("store", keys_of([], [0, 1]), 2)
    accesses.record("store", keys_of([], [7]), 3)
    accesses.fail("store", 1, "job 1", "cpu")
    accesses.retire("store", 1)
    assert accesses.first_failed("store", "cpu", np.arange(2)) is None  # 2 wrote them since
    assert accesses.touching("store", "cpu", np.arange(2), 2).tolist() == [2]
    accesses.retire("store", 2)
    assert not accesses.has_failed("store")


def test_a_failed_job_with_keys_outside_the_table_is_reported_once_and_remembered_for_none():
    for flushed in (True, False):
        accesses = LaneAccesses(8, 8)
        accesses.record("store", keys_of([0], [0, 9]), 1)
        if flushed:
            with pytest.raises(IndexError, match="outside the table"):
                accesses.touching("store", "cpu", np.arange(8), 1)
        accesses.fail("store", 1, "bad", "cpu")
        if not flushed:
            with pytest.raises(IndexError, match="outside the table"):
                accesses.retire("store", 1)
        accesses.retire("store", 1)
        assert not accesses.has_failed("store")
        accesses.record("store", keys_of([1], [1]), 2)
        accesses.retire("store", 2)
        assert accesses.touching("store", "cpu", np.arange(8), 1).size == 0


def test_a_record_interrupted_at_any_line_and_repeated_tracks_the_job_once():
    for n in range(1, 8):
        accesses, lines = LaneAccesses(8, 8), [0]

        def local(frame, event, arg):
            if event == "line":
                lines[0] += 1
                if lines[0] == n:
                    raise KeyboardInterrupt
            return local

        sys.settrace(lambda frame, event, arg: local if frame.f_code is LaneAccesses.record.__code__ else None)
        try:
            accesses.record("store", keys_of([0], [0, 1]), 1)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        accesses.record("store", keys_of([0], [0, 1]), 1)  # repeated, as the callers do
        assert accesses.touching("store", "cpu", np.arange(8), 1).tolist() == [1]
        assert [entry[0] for entry in accesses._jobs["store"]] == [1]


def test_a_lane_never_recorded_touches_nothing():
    accesses = LaneAccesses(8, 8)
    accesses.record("store", keys_of(np.arange(3), np.arange(4)), 1)
    assert accesses.touching("load", "gpu", np.arange(8), 0).size == 0
    assert accesses.first_failed("load", "cpu", np.arange(8)) is None
    accesses.fail("store", 1, "a", "cpu")
    accesses.retire("store", 1)
    assert accesses.first_failed("load", "cpu", np.arange(8)) is None
    assert accesses.first_failed("store", "cpu", np.arange(8)) == "a"


def test_keys_are_made_only_when_written():
    made = []
    accesses = LaneAccesses(8, 8)
    for seq in (1, 2):
        accesses.record("store", LazyKeys(lambda seq=seq: made.append(seq) or (np.arange(seq), np.arange(seq))), seq)
    accesses.retire("store", 1)
    assert made == []
    assert accesses.touching("store", "gpu", np.arange(8), 1).tolist() == [2]
    assert accesses.touching("store", "cpu", np.arange(8), 1).tolist() == [2]
    assert made == [2]


def test_keys_outside_the_table_are_an_index_error_once_and_nothing_is_written():
    accesses = LaneAccesses(8, 8)
    accesses.record("store", keys_of(np.arange(8), np.arange(8)), 1)
    for seq, bad in ((2, 8), (3, -1)):
        accesses.record("store", keys_of(np.array([0, 1, bad]), np.arange(2)), seq)
        with pytest.raises(IndexError, match=rf"^a_keys\[2\] = {bad} is outside the table of 8"):
            accesses.touching("store", "gpu", np.arange(8), 1)
        assert accesses.touching("store", "gpu", np.arange(8), 1).tolist() == [1]  # dropped
        with pytest.raises(IndexError, match="outside the table"):
            accesses.touching("store", "gpu", np.array([0, 1, bad]), 1)
    assert accesses.touching("store", "cpu", np.arange(8), 1).tolist() == [1]


@pytest.mark.parametrize("n", [1000, 65000, 200000])
def test_keys_changed_by_another_thread_mid_call_never_reach_outside_the_table(n):
    # The GIL is released while the tables are filled and read: a key checked in range
    # may be out of range when it is used. It must then be skipped, not followed.
    table, keys = np.zeros(n, np.int64), np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(n)
    stop = threading.Event()

    def flip():
        while not stop.is_set():
            i = int(rng.integers(n))
            keys[i] = 1 << 40
            keys[i] = i

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for call in (lambda: _C.tables_fill(table, keys, np.zeros(1, np.int64), keys[:0], 5),
                         lambda: _C.table_since(table, keys, 0)):
                try:
                    call()
                except IndexError:
                    pass
    finally:
        stop.set()
        flipper.join()
    assert set(np.unique(table)) <= {0, 5}


@pytest.mark.parametrize("n", [10, 200000])
def test_one_calls_table_as_the_others_keys_never_writes_outside(n):
    a, a_keys, b = np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.zeros(4, np.int64)
    _C.tables_fill(a, a_keys, b, a, 1 << 40)  # b's keys (a) pass the check, then become 2^40
    assert (a == 1 << 40).all() and set(b.tolist()) <= {0, 1 << 40}


def test_forgetting_interrupted_at_any_line_and_repeated_never_forgets_a_failure_still_last():
    # Each step is repeated after an interrupt, as the callers do; a failure may then be
    # remembered with no key left (a cost, not an error), never forgotten early.
    lines_of = {f.__code__ for f in vars(LaneAccesses).values() if callable(f)}
    for n in range(1, 400):
        accesses, lines, hit = LaneAccesses(8, 8), [0], [False]

        def local(frame, event, arg):
            if event == "line":
                lines[0] += 1
                if lines[0] == n:
                    hit[0] = True
                    raise KeyboardInterrupt
            return local

        def step(call):
            sys.settrace(lambda frame, event, arg: local if frame.f_code in lines_of else None)
            try:
                call()
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            call()

        def store(seq, cpu, failed=False):
            step(lambda: accesses.record("store", keys_of([], cpu), seq))
            if failed:
                step(lambda: accesses.fail("store", seq, f"job {seq}", "cpu"))
            step(lambda: accesses.retire("store", seq))

        store(1, [0, 1, 2, 3, 3], failed=True)
        step(lambda: accesses.first_failed("store", "cpu", np.arange(4)))
        assert all(accesses.first_failed("store", "cpu", [k]) == "job 1" for k in range(4))
        store(2, [0, 1, 1, 5])
        assert accesses.first_failed("store", "cpu", np.arange(2)) is None
        assert accesses.first_failed("store", "cpu", np.arange(4)) == "job 1"
        store(3, [3, 2, 6], failed=True)
        assert accesses.first_failed("store", "cpu", np.arange(4)) == "job 3"
        store(4, [2, 3, 6])
        assert accesses.first_failed("store", "cpu", np.arange(8)) is None
        store(5, [7])  # a count an interrupt left high is recounted at the next write
        assert not accesses.has_failed("store")
        if not hit[0]:
            break
    assert n > 50


def interrupted_at(function, text, call):
    """Calls call(), interrupted at the first line of ``function`` that holds ``text``."""
    code = function.__code__
    with open(code.co_filename) as f:
        lines = f.read().splitlines()

    def local(frame, event, arg):
        if event == "line" and text in lines[frame.f_lineno - 1]:
            raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_a_failure_remembered_again_after_a_later_write_keeps_the_keys_it_still_holds():
    accesses = LaneAccesses(4, 4)
    accesses.record("store", keys_of([], [0, 1]), 1)  # fails
    accesses.record("store", keys_of([], [0]), 2)  # rewrites key 0, in flight
    accesses.fail("store", 1, "job 1", "cpu")
    assert interrupted_at(LaneAccesses.retire, "jobs.popleft()", lambda: accesses.retire("store", 1))
    # Another lane asks before the retire is repeated: job 2 is written, interrupted
    # before its keys are taken from the failure.
    assert interrupted_at(LaneAccesses._write, "for side, keys in zip(SIDES",
                          lambda: accesses.touching("store", "cpu", np.array([0]), 2))
    accesses.retire("store", 1)
    accesses.retire("store", 2)
    assert accesses.first_failed("store", "cpu", np.array([1])) == "job 1"  # never rewritten
    assert accesses.first_failed("store", "cpu", np.array([0])) is None
