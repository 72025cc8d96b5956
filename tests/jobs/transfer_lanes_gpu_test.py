"""kvoffload.jobs.lanes.CudaLanes on a GPU: a job starts after the work queued on the
compute stream before it was submitted, a lane's jobs finish in submission order, a job
whose copy raises is reported by finish() and the lane goes on, and fence() makes a
stream wait for the jobs submitted so far."""

import numpy as np
import pytest
import torch

from kvoffload.jobs.lanes import CudaLanes

import lane_jobs
from scale import scaled
from scatter import POISON

SLEEP_CYCLES = 10_000_000  # a few milliseconds of GPU time: far longer than enqueueing a job
N = 1 << 20


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


@pytest.fixture
def lanes():
    lanes = CudaLanes(torch, torch.device("cuda", torch.cuda.current_device()), ["store", "load"])
    yield lanes
    lanes.close()


def filled(value):
    return torch.full((N,), value, dtype=torch.uint8, device="cuda")


def copy_of(src, dst, sleep_cycles=0):
    """A job: on the stream it is given, (sleeps, then) copies src into dst."""
    def copy(stream):
        with torch.cuda.stream(stream):
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            dst.copy_(src, non_blocking=True)
    return copy


def test_a_job_starts_after_the_compute_streams_work_queued_before_submit(lanes):
    src, dst = filled(0), filled(POISON)
    torch.cuda.synchronize()
    for trial in range(scaled(20)):
        value = trial % 250 + 1
        torch.cuda._sleep(SLEEP_CYCLES)  # on the current (compute) stream
        src.fill_(value)
        handle = lane_jobs.submit(lanes, "store", copy_of(src, dst), [])
        lanes.wait(handle)
        assert lane_jobs.finish(lanes, handle)[1] is None
        assert (dst == value).all(), f"trial {trial}: the job copied before the compute stream wrote"


def test_a_lanes_jobs_finish_in_submission_order(lanes):
    rng = np.random.default_rng(0)
    dst = filled(POISON)
    sources = [filled(i + 1) for i in range(scaled(16))]
    torch.cuda.synchronize()
    # Longer sleeps first: run side by side, later jobs would finish first.
    handles = [lane_jobs.submit(lanes, "load", copy_of(src, dst, int(rng.integers(1, 4)) * SLEEP_CYCLES // (i + 1)), [])
               for i, src in enumerate(sources)]
    while not lanes.done(handles[-1]):
        # Asked last job first: any job done by then finished before the earlier ones are asked.
        done = [lanes.done(h) for h in reversed(handles)][::-1]
        assert done == sorted(done, reverse=True), f"done out of order: {done}"
    assert all(lanes.done(h) for h in handles)
    assert [lane_jobs.finish(lanes, h)[1] for h in handles] == [None] * len(handles)
    assert (dst == len(sources)).all()  # the last job's copy landed last


def test_a_job_whose_copy_raises_is_reported_and_later_jobs_run(lanes):
    src, dst, untouched = filled(7), filled(POISON), filled(POISON)
    torch.cuda.synchronize()

    def broken(stream):
        raise RuntimeError("block 3 is gone")

    failing = lane_jobs.submit(lanes, "store", broken, [])
    reader = lane_jobs.submit(lanes, "load", copy_of(src, untouched), [failing], failing_with=[failing])
    later = lane_jobs.submit(lanes, "store", copy_of(src, dst), [])
    lanes.wait(later)
    lanes.wait(reader)
    assert lanes.done(failing)
    assert lane_jobs.finish(lanes, failing)[1] == "RuntimeError: block 3 is gone"
    assert lane_jobs.finish(lanes, reader)[1] == ("reads bytes a failed job left partial "
                                       "(RuntimeError: block 3 is gone); nothing copied")
    assert lane_jobs.finish(lanes, later)[1] is None
    assert (dst == 7).all() and (untouched == POISON).all()


def test_fence_makes_a_stream_wait_for_the_submitted_jobs(lanes):
    src = filled(9)
    dsts = {lane: filled(POISON) for lane in ("store", "load")}
    torch.cuda.synchronize()
    handles = [lane_jobs.submit(lanes, lane, copy_of(src, dst, SLEEP_CYCLES), []) for lane, dst in dsts.items()]
    stream = torch.cuda.Stream()
    lanes.fence(stream)
    with torch.cuda.stream(stream):
        seen = {lane: dst.clone() for lane, dst in dsts.items()}
    stream.synchronize()
    for lane in dsts:
        assert (seen[lane] == 9).all(), f"the fenced stream read {lane}'s destination before its job"
    for handle in handles:
        lanes.wait(handle)
        assert lane_jobs.finish(lanes, handle)[1] is None
