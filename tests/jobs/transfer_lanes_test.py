"""kvoffload.jobs.lanes.HostLanes: one thread per lane runs the lane's jobs one at a
time in submission order; a job waits for the jobs it is given from other lanes, fails
without copying when one it reads from failed, and has its own exception reported by
finish(), never raised; done() and wait() answer from any thread; close() ends the
threads. Orders and timings are random, from seeded generators."""

import gc
import inspect
import pathlib
import re
import threading
import types
import time
import weakref

import numpy as np
import pytest

from kvoffload.jobs import handler
from kvoffload.jobs import lanes as transfer_lanes
from kvoffload.jobs.lanes import CudaLanes, HostLanes, Lanes

import lane_jobs

LANES = ["store", "load", "expedited"]
TIMEOUT = 10.0  # seconds; every wait here ends within milliseconds unless lanes hang
SEEDS = range(6)


@pytest.fixture(autouse=True)
def _fake_streams_never_capture(monkeypatch):
    # CudaLanes here run on fake streams; transfer_lanes_gpu_test and graph_capture_gpu_test
    # ask the driver.
    monkeypatch.setattr(transfer_lanes, "_require_not_capturing", lambda stream, name: None)
    monkeypatch.setattr(transfer_lanes, "_relaxed", lambda fn: fn())


def within(fn, timeout=TIMEOUT):
    """fn() run on another thread: its result, or a failure if it has not returned in time."""
    out = {}

    def call():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            out["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} has not returned after {timeout} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def settle(lanes, handles):
    """Waits, with a deadline, until every handle is done."""
    def all_done():
        while not all(lanes.done(h) for h in handles):
            time.sleep(0.001)
    within(all_done)


@pytest.fixture
def lanes():
    lanes = HostLanes(LANES)
    yield lanes
    within(lanes.close)


class Log:
    """What the jobs did, in the order they did it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.events = []  # ("start" | "end", job)
        self.ended = set()

    def job(self, i, seconds, waits_for=(), fail=False):
        """Job i's copy: logs its start, checks that the jobs `waits_for` have ended,
        sleeps, raises if `fail`, else logs its end."""
        def copy():
            with self._lock:
                self.events.append(("start", i))
                early = sorted(set(waits_for) - self.ended)
            assert not early, f"job {i} started before jobs {early} ended"
            time.sleep(seconds)
            if fail:
                raise RuntimeError(f"job {i} broke")
            with self._lock:
                self.events.append(("end", i))
                self.ended.add(i)
        return copy


def random_lane(rng):
    return LANES[rng.integers(len(LANES))]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_lanes_jobs_run_one_at_a_time_in_submission_order(lanes, seed):
    rng = np.random.default_rng(seed)
    log, handles, lane_of = Log(), [], []
    for i in range(60):
        lane_of.append(random_lane(rng))
        handles.append(lane_jobs.submit(lanes, lane_of[i], log.job(i, rng.uniform(0, 0.002)), []))
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0, 0.002))
    settle(lanes, handles)
    assert [lane_jobs.finish(lanes, h)[1] for h in handles] == [None] * len(handles)
    for lane in LANES:
        ours = [i for i in range(len(lane_of)) if lane_of[i] == lane]
        # Each job starts after the one before it ended, in submission order.
        assert [event for event in log.events if event[1] in ours] == \
            [(kind, i) for i in ours for kind in ("start", "end")], lane


@pytest.mark.parametrize("seed", SEEDS)
def test_a_job_starts_after_the_jobs_it_waits_for(lanes, seed):
    rng = np.random.default_rng(seed)
    log, handles, lane_of = Log(), [], []
    for i in range(60):
        lane = random_lane(rng)
        others = [j for j in range(i) if lane_of[j] != lane]
        waits = sorted(rng.choice(others, size=min(len(others), int(rng.integers(0, 4))), replace=False).tolist())
        handles.append(lane_jobs.submit(lanes, lane, log.job(i, rng.uniform(0, 0.003), waits_for=waits),
                                    [handles[j] for j in waits]))
        lane_of.append(lane)
    settle(lanes, handles)
    assert [lane_jobs.finish(lanes, h)[1] for h in handles] == [None] * len(handles)
    assert log.ended == set(range(len(handles)))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_job_reading_from_a_failed_job_fails_without_copying(lanes, seed):
    rng = np.random.default_rng(seed)
    log, handles, want = Log(), [], []  # want[i]: job i's error, or None
    for i in range(60):
        lane = random_lane(rng)
        waits = sorted(rng.choice(i, size=min(i, int(rng.integers(0, 4))), replace=False).tolist())
        reads = [j for j in waits if rng.random() < 0.6]
        fail = bool(rng.random() < 0.25)
        failed = [want[j] for j in reads if want[j] is not None]
        want.append(f"reads bytes a failed job left partial ({failed[0]}); nothing copied" if failed
                    else f"RuntimeError: job {i} broke" if fail else None)
        handles.append(lane_jobs.submit(lanes, lane, log.job(i, rng.uniform(0, 0.001), fail=fail),
                                    [handles[j] for j in waits], failing_with=[handles[j] for j in reads]))
    settle(lanes, handles)
    assert [lane_jobs.finish(lanes, h)[1] for h in handles] == want
    # Jobs that read from a failed one never started copying.
    started = {i for kind, i in log.events if kind == "start"}
    assert started == {i for i, error in enumerate(want) if error is None or error.startswith("RuntimeError")}
    assert any(error and error.startswith("reads") for error in want)


def test_a_jobs_exception_is_reported_by_finish_and_later_jobs_still_run(lanes):
    log = Log()

    def broken():
        raise ValueError("no such block")

    first = lane_jobs.submit(lanes, "load", log.job(0, 0.001), [])
    failing = lane_jobs.submit(lanes, "load", broken, [first])  # returns: the error is the job's
    later = [lane_jobs.submit(lanes, "load", log.job(i, 0.001), []) for i in (2, 3)]
    settle(lanes, [first, failing, *later])
    assert lanes.wait(failing) == "ValueError: no such block"
    assert lane_jobs.finish(lanes, failing)[1] == "ValueError: no such block"
    assert [lane_jobs.finish(lanes, h)[1] for h in (first, *later)] == [None] * 3
    assert log.ended == {0, 2, 3}


def test_finish_reports_the_time_the_copy_took(lanes):
    handle = lane_jobs.submit(lanes, "store", lambda: time.sleep(0.05), [])
    within(lambda: lanes.wait(handle))
    seconds, error = lane_jobs.finish(lanes, handle)
    assert error is None and 0.05 <= seconds < 5


@pytest.mark.parametrize("seed", SEEDS)
def test_done_and_wait_answer_from_other_threads(lanes, seed):
    rng = np.random.default_rng(seed)
    gate = threading.Event()
    blocked = lane_jobs.submit(lanes, random_lane(rng), lambda: gate.wait(TIMEOUT), [])
    returned = []
    waiters = [threading.Thread(target=lambda: returned.append(lanes.wait(blocked)), daemon=True)
               for _ in range(int(rng.integers(1, 4)))]
    for waiter in waiters:
        waiter.start()
    time.sleep(rng.uniform(0.01, 0.03))
    assert within(lambda: lanes.done(blocked)) is False
    assert not returned and all(waiter.is_alive() for waiter in waiters)
    gate.set()
    for waiter in waiters:
        waiter.join(TIMEOUT)
    assert returned == [None] * len(waiters)
    assert within(lambda: lanes.done(blocked)) is True
    assert lane_jobs.finish(lanes, blocked)[1] is None


def test_close_ends_the_lanes_threads():
    rng = np.random.default_rng(0)
    before = set(threading.enumerate())
    lanes = HostLanes(LANES)
    threads = set(threading.enumerate()) - before
    assert len(threads) == len(LANES)
    handles = [lane_jobs.submit(lanes, random_lane(rng), lambda: time.sleep(0.001), []) for _ in range(20)]
    settle(lanes, handles)
    within(lanes.close)
    assert not any(thread.is_alive() for thread in threads)


class _Event:
    """Stands in for torch.cuda.Event: everything recorded is done at once."""

    def __init__(self, enable_timing=False):
        del enable_timing

    def record(self, stream=None):
        del stream

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        del other
        return 0.5


class _Stream:
    def __init__(self, device=None, priority=0):
        del device, priority

    def wait_event(self, event):
        del event

    def wait_stream(self, stream):
        del stream

    def synchronize(self):
        pass


_FAKE_TORCH = types.SimpleNamespace(cuda=types.SimpleNamespace(
    Event=_Event, Stream=_Stream, current_stream=lambda device=None: _Stream()))


@pytest.mark.parametrize("relax", ["relaxes", "cannot relax"])
def test_cuda_lanes_enqueue_in_relaxed_capture_mode_or_else_in_their_own(monkeypatch, relax):
    # A lane thread runs its jobs inside the relaxed scope; where CUDA refuses the scope
    # (before it runs anything), the jobs still run, and nothing hangs.
    relaxed = threading.local()

    def scope(fn):
        if relax == "cannot relax" and threading.current_thread().name.startswith("kvoffload enqueue"):
            raise RuntimeError("cudaThreadExchangeStreamCaptureMode: injected")
        relaxed.on = True
        try:
            return fn()
        finally:
            relaxed.on = False

    monkeypatch.setattr(transfer_lanes, "_relaxed", scope)
    lanes = CudaLanes(_FAKE_TORCH, 0, ["store", "load"])
    seen = []
    jobs = [lane_jobs.submit(lanes, lane, lambda stream: seen.append(getattr(relaxed, "on", False)), [])
            for lane in ("store", "load", "store")]
    for job in jobs:
        within(lambda job=job: lanes.wait(job))
    assert seen == [relax == "relaxes"] * 3
    lanes.close()


def test_cuda_lanes_run_a_job_started_twice_once_and_go_on():
    # What the handler does after an interrupt between start() and its bookkeeping.
    lanes = CudaLanes(_FAKE_TORCH, 0, ["store", "load"])
    ran = []
    first = lanes.make("store", lambda stream: ran.append("first"), [])
    lanes.start(first)
    lanes.start(first)  # queued twice before it ran
    lanes.wait(first)
    lanes.start(first)  # and again after it ran
    later = lane_jobs.submit(lanes, "load", lambda stream: ran.append("later"), [first])
    assert later.queued.acquire(timeout=10), "the enqueue thread stopped"
    later.queued.release()
    assert ran == ["first", "later"] and lane_jobs.finish(lanes, later) == (0.5e-3, None)
    lanes.close()
    lanes.close()  # idempotent


def test_only_pipelined_jobs_in_a_row_go_on_the_lanes_other_stream():
    lanes = CudaLanes(_FAKE_TORCH, 0, ["store", "load"])
    rng = np.random.default_rng(8)
    kinds = [bool(k) for k in rng.integers(0, 2, size=40)]
    seen = {"store": [], "load": []}
    handles = []
    for lane in ("store", "load"):
        for pipelined in kinds:
            handles.append(lane_jobs.submit(lanes, lane, lambda stream, lane=lane: seen[lane].append(stream), [],
                                        pipelined=pipelined))
    for handle in handles:
        lanes.wait(handle)
    for lane in ("store", "load"):
        streams = seen[lane]
        assert len(streams) == len(kinds) and len({id(s) for s in streams}) == 2
        for i in range(1, len(kinds)):
            assert (streams[i] is not streams[i - 1]) == (kinds[i] and kinds[i - 1]), i
    assert not {id(s) for s in seen["store"]} & {id(s) for s in seen["load"]}
    lanes.close()


class _Op:
    """A stream operation and what it comes after, on its stream and through waits."""

    def __init__(self, after):
        self.after = [op for op in after if op is not None]

    def follows(self, op) -> bool:
        seen, todo = set(), [self]
        while todo:
            node = todo.pop()
            if node is op:
                return True
            if id(node) not in seen:
                seen.add(id(node))
                todo += node.after
        return False


class _OrderedStream(_Stream):
    def __init__(self, device=None, priority=0):
        super().__init__(device, priority)
        self.last = None

    def op(self, *after):
        self.last = _Op([self.last, *after])
        return self.last

    def wait_event(self, event):
        self.op(event.op)

    def wait_stream(self, stream):
        self.op(stream.last)


class _OrderedEvent(_Event):
    op = None

    def record(self, stream=None):
        self.op = stream.op()


def _ordered_torch():
    """A fake torch whose streams and events record what follows what."""
    compute = _OrderedStream()
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=_OrderedEvent, Stream=_OrderedStream, current_stream=lambda device=None: compute))


@pytest.mark.parametrize("second", ["fails to enqueue", "reads partial bytes", "copies"])
def test_a_pipelined_job_ends_after_the_one_before_it_even_if_it_copies_nothing(second):
    # Another lane waits only for a lane's latest job: that job's end must follow every
    # earlier job's copies, which the ring orders only when it copies through the ring.
    compute, ring = _OrderedStream(), _OrderedStream()
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=_OrderedEvent, Stream=_OrderedStream, current_stream=lambda device=None: compute))
    copied = {}

    def through_ring(name):
        def copy(stream):
            ring.op(stream.last)  # the ring starts after the lane's waits
            copied[name] = ring.op()
            stream.wait_stream(ring)  # and the lane waits for the ring
        return copy

    def fail(stream):
        raise RuntimeError("cudaMalloc (staging ring): out of memory")

    lanes = CudaLanes(torch, 0, ["store", "load"])
    failed_store = lane_jobs.submit(lanes, "store", fail, [])
    lane_jobs.submit(lanes, "load", through_ring("first"), [], pipelined=True)
    copy = {"fails to enqueue": fail, "reads partial bytes": through_ring("second"),
            "copies": through_ring("second")}[second]
    sources = [failed_store] if second == "reads partial bytes" else []
    last = lane_jobs.submit(lanes, "load", copy, sources, failing_with=sources, pipelined=True)
    lanes.wait(last)
    assert (last.error is None) == (second == "copies")
    assert last.end.op.follows(copied["first"])
    lanes.close()


def test_cuda_lanes_resolve_each_job_on_its_lanes_thread_in_submission_order():
    lanes = CudaLanes(_ordered_torch(), 0, LANES)
    rng = np.random.default_rng(3)
    resolved, copied, handles = [], {}, []

    def copy(i):
        def call(stream):
            if i == 7:
                raise RuntimeError("job 7 broke")
            copied[i] = stream.op()
        return call

    def resolve(i, waits_for):
        def call(job):
            resolved.append((i, threading.current_thread().name))
            if i == 11:
                raise IndexError("keys outside the tables")
            waits = [handles[j] for j in waits_for]
            return waits, waits if i % 2 else []  # odd jobs read what they wait for
        return call

    waits_for, lane_of = {}, {}
    for i in range(24):
        waits_for[i] = sorted(set(rng.integers(0, i, size=2).tolist())) if i else []
        lane_of[i] = random_lane(rng)
        handles.append(lane_jobs.submit(lanes, lane_of[i], copy(i), [], resolve=resolve(i, waits_for[i])))
    for handle in handles:
        lanes.wait(handle)
    assert [i for i, _ in resolved] == list(range(24))
    assert all(name == f"kvoffload enqueue {lane_of[i]}" for i, name in resolved)
    for i, handle in enumerate(handles):
        broken = i in (7, 11) or (i % 2 and any(handles[j].error for j in waits_for[i]))
        assert (handle.error is not None) == broken, i
        assert (i in copied) == (not broken), i
        for j in waits_for[i]:
            if j in copied and i in copied:
                assert copied[i].follows(copied[j]), (i, j)
    assert "IndexError: keys outside the tables" in handles[11].error
    lanes.close()


def test_host_lanes_refuse_resolve(lanes):
    with pytest.raises(ValueError, match="resolve"):
        lanes.make("store", lambda: None, [], resolve=lambda job: ([], []))


class _TimedStream(_Stream):
    """A stream's GPU time: what it waits for and what it copies move it on."""

    def __init__(self, device=None, priority=0):
        super().__init__(device, priority)
        self.now = 0.0

    def wait_event(self, event):
        self.now = max(self.now, event.t)


class _TimedEvent(_Event):
    def record(self, stream=None):
        self.t = stream.now

    def elapsed_time(self, other):
        return other.t - self.t


def test_a_pipelined_job_is_timed_from_the_end_of_the_one_before_it_whose_events_wait():
    # Both jobs' waits are met at 0; each copies 10 ms through one ring in turn. The
    # second's time is its own 10 ms, not the 20 it spent queued behind the first.
    compute, ring = _TimedStream(), _TimedStream()
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=_TimedEvent, Stream=_TimedStream, current_stream=lambda device=None: compute))

    def through_ring(stream):
        ring.now = max(ring.now, stream.now) + 10.0
        stream.now = ring.now

    lanes = CudaLanes(torch, 0, ["store", "load"])
    first = lane_jobs.submit(lanes, "load", through_ring, [], pipelined=True)
    second = lane_jobs.submit(lanes, "load", through_ring, [], pipelined=True)
    lanes.wait(second)
    assert lane_jobs.finish(lanes, first) == (0.01, None)
    first_events = {id(first.start), id(first.end)}
    while_held = lane_jobs.submit(lanes, "store", through_ring, [])  # may not take the first's events yet
    assert not first_events & {id(while_held.start), id(while_held.end)}
    assert lane_jobs.finish(lanes, second) == (0.01, None)
    assert lane_jobs.finish(lanes, while_held)[1] is None
    reused = [lanes.make("store", through_ring, []) for _ in range(3)]
    assert first_events <= {id(e) for job in reused for e in (job.start, job.end)}
    lanes.close()


def test_a_kept_handle_keeps_no_later_pipelined_job_alive():
    # LaneConflicts keeps a failed store's handle for good: it must not hold its lane's
    # later jobs through the pipelining bookkeeping.
    lanes = CudaLanes(_FAKE_TORCH, 0, ["store", "load"])
    kept = lane_jobs.submit(lanes, "store", lambda stream: None, [], pipelined=True)
    lanes.wait(kept)
    lane_jobs.finish(lanes, kept)
    later = []
    for _ in range(50):
        handle = lane_jobs.submit(lanes, "store", lambda stream: None, [], pipelined=True)
        lanes.wait(handle)
        lane_jobs.finish(lanes, handle)
        later.append(weakref.ref(handle))
    del handle
    lanes.close()
    gc.collect()
    assert sum(ref() is not None for ref in later) <= 2  # the lanes' last job or two


class _CountedEvent(_Event):
    def __init__(self, enable_timing=False):
        super().__init__(enable_timing)
        self.records = 0

    def record(self, stream=None):
        self.records += 1


class _WaitLog(_Stream):
    def __init__(self, device=None, priority=0):
        super().__init__(device, priority)
        self.waited = []

    def wait_event(self, event):
        self.waited.append((event, event.records))


def test_a_pipelined_job_never_waits_on_the_reused_end_of_a_collected_job_before_it():
    # The handler's order: load B is collected (its events recycled), store K takes B's
    # events and is enqueued, then load J comes in behind B on the lane's other stream.
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=_CountedEvent, Stream=_WaitLog, current_stream=lambda device=None: _WaitLog()))
    lanes = CudaLanes(torch, 0, ["store", "load"])
    b = lane_jobs.submit(lanes, "load", lambda stream: None, [], pipelined=True)
    lanes.wait(b)
    b_end, b_records = b.end, b.end.records
    lane_jobs.finish(lanes, b)
    k = lane_jobs.submit(lanes, "store", lambda stream: None, [], pipelined=True)
    assert k.end is b_end
    lanes.wait(k)
    streams = []
    j = lane_jobs.submit(lanes, "load", lambda stream: streams.append(stream), [], pipelined=True)
    lanes.wait(j)
    lanes.close()
    assert all(records == b_records for event, records in streams[0].waited if event is b_end)


def test_one_lanes_enqueueing_does_not_hold_up_another_lanes():
    # A store whose enqueueing lasts until the load after it has been enqueued: with one
    # enqueue thread for both lanes it would wait out its whole timeout.
    lanes = CudaLanes(_FAKE_TORCH, 0, LANES)
    load_enqueued = threading.Event()
    waited = []
    store = lane_jobs.submit(lanes, "store", lambda stream: waited.append(load_enqueued.wait(TIMEOUT)), [])
    load = lane_jobs.submit(lanes, "load", lambda stream: load_enqueued.set(), [])
    for handle in (store, load):
        lanes.wait(handle)
    assert waited == [True] and store.error is None and load.error is None
    lanes.close()


def test_a_job_waiting_for_another_lanes_job_waits_until_that_one_is_enqueued():
    lanes = CudaLanes(_ordered_torch(), 0, LANES)
    release, copied = threading.Event(), {}

    def store(stream):
        release.wait(TIMEOUT)
        copied["store"] = stream.op()

    first = lane_jobs.submit(lanes, "store", store, [])
    second = lane_jobs.submit(lanes, "load", lambda stream: copied.__setitem__("load", stream.op()), [first])
    time.sleep(0.05)
    assert "load" not in copied  # still waiting on the host for the store's enqueueing
    release.set()
    for handle in (first, second):
        lanes.wait(handle)
    assert copied["load"].follows(copied["store"])
    lanes.close()


def test_a_job_started_again_after_its_turn_takes_no_second_turn():
    # The handler starts a job again after an interrupt; that start can read the job as
    # not yet taken, then add its turn only after the lane's thread ended it.
    lanes = CudaLanes(_FAKE_TORCH, 0, LANES)
    job = lanes.make("store", lambda stream: None, [])
    lanes.start(job)
    item = job.item
    within(lambda: lanes.wait(job))
    lanes._turns.add(job)  # what the late second start adds, and queues
    lanes._queues["store"].put(item)
    later = lane_jobs.submit(lanes, "load", lambda stream: None, [])
    within(lambda: lanes.wait(later))
    lanes.close()


def test_fence_waits_for_a_job_whose_start_was_interrupted_after_it_was_queued():
    lanes = CudaLanes(_FAKE_TORCH, 0, LANES)
    release = threading.Event()
    job = lanes.make("store", lambda stream: release.wait(TIMEOUT), [])
    queued = lanes._queues["store"]

    class Interrupted:
        def put(self, item):
            queued.put(item)
            raise KeyboardInterrupt

    lanes._queues["store"] = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        lanes.start(job)
    lanes._queues["store"] = queued
    time.sleep(0.05)  # the lane's thread takes it
    lanes.start(job)  # the handler's next call starts it again
    fenced = threading.Event()
    fencing = threading.Thread(target=lambda: (lanes.fence(_FAKE_TORCH.cuda.current_stream()), fenced.set()))
    fencing.start()
    assert not fenced.wait(0.1), "fence returned before the job was enqueued"
    release.set()
    assert fenced.wait(TIMEOUT)
    lanes.close()


def test_close_from_a_lanes_own_thread_does_not_wait_for_the_others():
    # A handler's finalizer can run on a lane's thread, mid-copy, while another lane's
    # job waits for that copy's job.
    lanes = CudaLanes(_FAKE_TORCH, 0, LANES)
    store = lane_jobs.submit(lanes, "store", lambda stream: lanes.close(), [])
    load = lane_jobs.submit(lanes, "load", lambda stream: None, [store])
    within(lambda: lanes.wait(load))
    assert store.error is None and load.error is None


def test_a_wait_for_a_recycled_job_does_not_follow_the_job_given_its_events():
    lanes = CudaLanes(_ordered_torch(), 0, LANES)
    go, ops = threading.Event(), {}
    done = lane_jobs.submit(lanes, "expedited", lambda stream: None, [])
    lanes.wait(done)
    slow = lane_jobs.submit(lanes, "store", lambda stream: go.wait(TIMEOUT), [])
    waiting = lane_jobs.submit(lanes, "load", lambda stream: ops.__setitem__("waiting", stream.op()), [slow, done])
    assert lanes.done(done)
    lane_jobs.finish(lanes, done)  # collected: its events go back to the pool
    later = lane_jobs.submit(lanes, "expedited", lambda stream: ops.__setitem__("later", stream.op()), [])
    assert later.end is done.end
    lanes.wait(later)
    go.set()
    lanes.wait(waiting)
    assert not ops["waiting"].follows(ops["later"])
    lanes.close()


def test_both_kinds_of_lanes_take_the_protocols_calls_and_the_handler_calls_each_of_them():
    calls = [name for name in vars(Lanes) if not name.startswith("_")]
    handler_source = pathlib.Path(handler.__file__).read_text()
    assert set(re.findall(r"self\._lanes\.(\w+)", handler_source)) == set(calls)
    for cls in (CudaLanes, HostLanes):
        for name in calls:
            want = [p for p in inspect.signature(getattr(Lanes, name)).parameters if p != "self"]
            got = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
            assert got == want, (cls.__name__, name)


def test_host_lanes_refuse_a_fence_naming_it():
    lanes = HostLanes(["store", "load"])
    try:
        with pytest.raises(RuntimeError, match=r"fence: only for a handler of GPU tensors"):
            lanes.fence(None)
    finally:
        lanes.close()
