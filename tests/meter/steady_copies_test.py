"""kvoffload.meter.sources without a GPU: jobs kept at their depth per direction, each
spec taken in turn, bytes counted once, failures raised; a handler behind vLLM's verbs
moves what the model of its pool says; raw calls kept at their depth."""

import collections
import random

import numpy as np
import pytest

from kv_model import check, make_handler
from kvoffload.meter.sources import BulkCopies, HandlerAsWorker, RawCopies, WorkerCopies, in_calls
from kvoffload.pages.planner import CPUSpec, GPUSpec


class FakeWorker:
    """vLLM's worker verbs; jobs finish when ``finish`` says, in random order."""

    Result = collections.namedtuple("Result", "job_id success transfer_size transfer_time")

    def __init__(self, seed, fail=None):
        self.rng = random.Random(seed)
        self.flying, self.done, self.log = {}, [], []
        self.fail = fail

    def submit_store(self, job_id, gpu, cpu):
        return self._submit("store", job_id, gpu, cpu)

    def submit_load(self, job_id, cpu, gpu):
        return self._submit("load", job_id, gpu, cpu)

    def _submit(self, direction, job_id, gpu, cpu):
        assert job_id not in self.flying
        self.flying[job_id] = (direction, gpu, cpu)
        self.log.append((direction, gpu, cpu))
        return True

    def finish(self, count):
        for job_id in self.rng.sample(sorted(self.flying), min(count, len(self.flying))):
            _, gpu, _ = self.flying.pop(job_id)
            self.done.append(self.Result(job_id, job_id != self.fail, gpu, 0.0))

    def get_finished(self):
        done, self.done = self.done, []
        return done

    def wait(self, ids):
        for job_id in ids:
            if job_id in self.flying:
                self.finish(len(self.flying))


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("direction", ["store", "load", "both"])
def test_jobs_stay_at_depth_and_every_byte_is_counted_once(seed, direction):
    rng = random.Random(seed)
    depth = rng.randint(1, 4)
    # A spec's "GPU side" is the bytes it moves, so the log says what was submitted.
    jobs = {d: [(rng.randint(1, 1000), f"{d}-cpu-{i}") for i in range(rng.randint(1, 5))]
            for d in ("store", "load")}
    worker = FakeWorker(seed)
    copies = WorkerCopies(worker, jobs, direction, depth)
    directions = ("store", "load") if direction == "both" else (direction,)
    for _ in range(50):
        copies.top_up()
        in_flight = collections.Counter(d for d, _, _ in worker.flying.values())
        assert dict(in_flight) == {d: depth for d in directions}
        worker.finish(rng.randint(0, 2 * depth))
    moved = copies.drain()
    assert not worker.flying
    assert moved == sum(size for _, size, _ in worker.log)
    for d in directions:  # each direction's specs in turn, from the first
        taken = [(size, cpu) for dd, size, cpu in worker.log if dd == d]
        assert taken == [jobs[d][i % len(jobs[d])] for i in range(len(taken))]
    assert copies.drain() == 0  # the count restarts


def test_a_failed_job_raises():
    worker = FakeWorker(0)
    copies = WorkerCopies(worker, {"store": [(10, "c")]}, "store", 2)
    copies.top_up()
    worker.fail = next(iter(worker.flying))
    worker.finish(2)
    with pytest.raises(RuntimeError, match=f"job {worker.fail} failed"):
        copies.top_up()


def test_a_bad_direction_is_named():
    with pytest.raises(ValueError, match="direction: expected one of"):
        WorkerCopies(FakeWorker(0), {}, "sideways")


@pytest.mark.parametrize("jobs, direction, match", [
    ({"store": []}, "store", r"jobs\['store'\]: expected \(GPU spec, CPU spec\) pairs"),
    ({"store": [(1, "c")]}, "both", r"jobs\['load'\]: expected"),
])
def test_missing_jobs_are_named(jobs, direction, match):
    with pytest.raises(ValueError, match=match):
        WorkerCopies(FakeWorker(0), jobs, direction)


@pytest.mark.parametrize("depth, error", [(0, ValueError), (-3, ValueError), (True, TypeError), (2.0, TypeError)])
def test_a_bad_depth_is_named(depth, error):
    with pytest.raises(error, match="depth: "):
        WorkerCopies(FakeWorker(0), {"store": [(1, "c")]}, "store", depth)


@pytest.mark.parametrize("args, match", [(dict(job_bytes=0), "job_bytes: must be >= 1"),
                                         (dict(depth=0), "depth: must be >= 1"),
                                         (dict(direction="up"), "direction: expected one of")])
def test_bulk_copies_check_their_arguments_before_allocating(args, match):
    class NoTorch:  # any allocation would fail on this
        pass

    with pytest.raises((ValueError, TypeError), match=match):
        BulkCopies(NoTorch(), **(dict(direction="store") | args))


@pytest.mark.parametrize("seed", range(3))
def test_a_handler_behind_the_worker_verbs_moves_its_jobs_exactly(seed):
    rng = np.random.default_rng(seed)
    handler, model = make_handler(rng, [256, 512], [2, 3], num_blocks=32, num_chunks=32, bpc=1,
                                  cpu_layout="chunk_major")
    # Overlapping chunks: the handler keeps a lane's stores in order, so the model replays
    # them in the order WorkerCopies takes the specs.
    stores = [(GPUSpec(rng.permutation(32)[:8], [4, 4], [0, 0]), CPUSpec(rng.permutation(16)[:8]))
              for _ in range(3)]
    copies = WorkerCopies(HandlerAsWorker(handler), {"store": stores}, "store", depth=2)
    for _ in range(5):
        copies.top_up()
    moved = copies.drain()
    job_bytes = 4 * (2 * 256 + 3 * 512)
    assert moved % job_bytes == 0 and moved >= 2 * job_bytes
    for i in range(moved // job_bytes):
        gpu, cpu = stores[i % len(stores)]
        model.store(gpu.block_ids, gpu.group_sizes, gpu.block_indices, cpu.chunk_ids)
    check(handler, model)
    handler.shutdown()


class FakeTorch:
    """Events that finish when the test says."""

    class cuda:
        done = set()

        class Event:
            made = []

            def __init__(self):
                self.made.append(self)

            def record(self, stream):
                self.stream = stream

            def query(self):
                return self in FakeTorch.cuda.done

            def synchronize(self):
                FakeTorch.cuda.done.add(self)


def test_raw_copies_stay_at_depth_and_count_each_call_once():
    made = []
    calls = [(lambda i=i: made.append(i), 100 * (i + 1)) for i in range(2)]
    copies = RawCopies(FakeTorch, calls, stream=None, depth=3)
    copies.top_up()
    assert made == [0, 1, 0]
    FakeTorch.cuda.done.update(e for e, _ in copies.flying[:2])
    copies.top_up()
    assert made == [0, 1, 0, 1, 0] and len(copies.flying) == 3
    assert copies.drain() == 100 + 200 + 100 + 200 + 100 and copies.drain() == 0


def test_a_raw_call_given_its_stream_is_followed_there():
    calls = [(lambda: None, 1, "ring stream 0"), (lambda: None, 1, "ring stream 1"), (lambda: None, 1)]
    copies = RawCopies(FakeTorch, calls, stream="default", depth=3)
    copies.top_up()
    assert [e.stream for e, _ in copies.flying] == ["ring stream 0", "ring stream 1", "default"]
    assert copies.drain() == 3


@pytest.mark.parametrize("args, error, match", [(dict(calls=[]), ValueError, "calls: expected"),
                                                (dict(depth=0), ValueError, "depth: must be >= 1"),
                                                (dict(depth=True), TypeError, "depth: ")])
def test_raw_copies_check_their_arguments(args, error, match):
    with pytest.raises(error, match=match):
        RawCopies(FakeTorch, **(dict(calls=[(lambda: None, 1)], stream=None) | args))


def calls_of(sizes, call_bytes):
    src = np.arange(len(sizes), dtype=np.int64) * 7 + 3
    dst = np.arange(len(sizes), dtype=np.int64) * 11 + 5
    made = []
    calls = in_calls(lambda s, d, z: made.append((s, d, z)), src, dst, sizes, call_bytes)
    for call, nbytes in calls:
        call()
        assert nbytes == made[-1][2].sum()
    return src, dst, made


@pytest.mark.parametrize("seed", range(20))
def test_calls_hold_every_copy_once_in_order(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5000, int(rng.integers(1, 400))).astype(np.int64)
    call_bytes = int(rng.integers(1, 20000))
    src, dst, made = calls_of(sizes, call_bytes)
    assert all(len(s) for s, _, _ in made)
    for got, want in zip((np.concatenate([m[k] for m in made]) for k in range(3)), (src, dst, sizes)):
        np.testing.assert_array_equal(got, want)
    # A call ends with the first copy that reaches the next multiple of call_bytes.
    start = 0
    for i, (_, _, z) in enumerate(made):
        ends = start + np.cumsum(z)
        assert (ends[:-1] // call_bytes == start // call_bytes).all()
        if i < len(made) - 1:
            assert ends[-1] // call_bytes > start // call_bytes
        start = ends[-1]


def test_equal_pages_split_evenly_and_no_copies_make_no_calls():
    _, _, made = calls_of(np.full(10_000, 4096, dtype=np.int64), 512 << 10)  # 128 pages a call
    assert [len(z) for _, _, z in made] == [128] * 78 + [16]
    assert calls_of(np.zeros(0, dtype=np.int64), 1 << 20)[2] == []
    with pytest.raises(ValueError, match="call_bytes: must be >= 1"):
        in_calls(print, np.zeros(1), np.zeros(1), np.ones(1, dtype=np.int64), 0)
