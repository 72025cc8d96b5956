"""kvoffload.meter and its copy sources on a GPU: the bytes arrive, every source gets its
windows between idle ones, copies cover their windows, a loop left dry by host work is
seen, a failing source is raised, the arguments are checked, and every workload runs
under the meter."""

import pytest
import torch

import kvoffload as kv
from kvoffload.meter import compute_loop, meter
from kvoffload.meter.sources import BulkCopies, RawCopies, in_calls


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


@pytest.fixture(scope="module")
def loop():
    return compute_loop.ComputeLoop(torch, "model")


@pytest.mark.parametrize("direction", ["store", "load", "both"])
def test_bulk_copies_move_the_buffers_and_count_them(direction):
    copies = BulkCopies(torch, direction, job_bytes=8 << 20, depth=3)
    for _, src, dst, _ in copies.lanes.values():
        src.copy_(torch.randint(0, 256, (src.numel(),), dtype=torch.uint8))
        dst.fill_(0xA5)
    torch.cuda.synchronize()
    for _ in range(5):
        copies.top_up()
    moved = copies.drain()
    for _, src, dst, _ in copies.lanes.values():
        assert torch.equal(src.cpu(), dst.cpu())
    # At least the first depth jobs per lane, each counted once.
    lanes = len(copies.lanes)
    assert moved >= 3 * lanes * (8 << 20) and moved % (8 << 20) == 0
    assert copies.drain() == 0


class Nothing:
    def __init__(self):
        self.top_ups = 0

    def top_up(self):
        self.top_ups += 1

    def drain(self):
        return 0


def test_each_source_gets_its_rounds_of_covered_windows(loop):
    made = []

    def make():
        made.append(Nothing())
        return made[-1]

    got = meter.measure(loop, {"a": make, "bulk": lambda: BulkCopies(torch, "load", 16 << 20)},
                        steps=20, rounds=2, margin=6)
    assert set(got) == {"a", "bulk"}
    assert len(made) == 2 and all(n.top_ups > 0 for n in made)  # fresh per window, fed in it
    for result in got.values():
        assert len(result.windows) == 2 and all(w["covered"] for w in result.windows)
        assert result.idle_drift in [w["idle_drift"] for w in result.windows]
    assert got["a"].gb_per_s == 0 and got["bulk"].gb_per_s > 0


def test_bad_arguments_are_named(loop):
    with pytest.raises(ValueError, match="margin"):
        meter.measure(loop, {"a": Nothing}, steps=10, margin=1)


def test_raw_copies_in_calls_move_the_bytes_and_count_each_call_once():
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8).pin_memory()
    dst = torch.full((src.numel(),), 0xA5, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    pages = torch.randperm(src.numel() // 4096).numpy().astype("int64") * 4096
    sizes = pages * 0 + 4096
    copy = lambda s, d, z: kv.batch_copy(s, d, z, stream, registry=kv.UNCHECKED)
    calls = in_calls(copy, src.data_ptr() + pages, dst.data_ptr() + pages, sizes, 1 << 20)
    assert len(calls) == 4
    copies = RawCopies(torch, calls, stream, depth=4)
    copies.top_up()
    assert copies.drain() == src.numel()
    assert torch.equal(dst.cpu(), src)
    copies.top_up()  # the calls again, from the first
    assert copies.drain() == src.numel() and copies.drain() == 0


class HoldsTheGil(Nothing):
    """Host work that holds the GIL (a C loop), as a submit that never releases it would."""

    def top_up(self):
        super().top_up()
        sum(range(20_000_000))


def test_steps_enqueued_only_after_the_gpu_ran_dry_are_counted(loop):
    got = meter.measure(loop, {"gil": HoldsTheGil, "nothing": Nothing}, steps=30, rounds=1, margin=6)
    assert got["gil"].dry_steps > 0
    assert got["nothing"].dry_steps == 0


class Fails(Nothing):
    def top_up(self):
        raise RuntimeError("enqueue failed")


def test_a_failing_source_is_raised_and_the_loop_still_runs(loop):
    with pytest.raises(RuntimeError, match="enqueue failed"):
        meter.measure(loop, {"fails": Fails}, steps=10, rounds=1, margin=4)
    assert len(loop._steps(3)) == 3


@pytest.mark.parametrize("workload", compute_loop.WORKLOADS)
def test_every_workload_is_a_loop_the_meter_runs(workload):
    loop = compute_loop.ComputeLoop(torch, workload)
    assert loop.step_seconds > 0
    made = []

    def make():
        made.append(Nothing())
        return made[-1]

    got = meter.measure(loop, {"a": make}, steps=10, rounds=2, margin=4, warm=0)
    assert len(made) == 2 and all(c.top_ups > 0 for c in made)
    assert len(got["a"].windows) == 2
