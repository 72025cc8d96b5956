"""kvoffload.compute_loop on a GPU: a loop covers copies longer than the driver's launch
queue holds of it, and what it reports matches the copies' own events."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload import compute_loop


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


@pytest.fixture(scope="module")
def loop():
    return compute_loop.ComputeLoop(torch, "model")


def copies(seconds_alone: float):
    """Back-to-back 4 KiB device copies, random source pages, about ``seconds_alone`` long
    on the stream; (enqueue, stream, bytes, measured seconds alone, src, dst)."""
    stream = torch.cuda.Stream()
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.full_like(src, 0xA5)
    pages = np.random.default_rng(0).permutation(src.numel() >> 12).astype(np.int64) << 12
    sizes = np.full(len(pages), 4096, dtype=np.int64)
    one = lambda: kv.batch_copy(src.data_ptr() + pages, dst.data_ptr() + pages, sizes, stream,
                                per_copy=True, registry=kv.UNCHECKED)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    one()
    end.record(stream)
    end.synchronize()
    alone = start.elapsed_time(end) / 1e3
    rounds = max(1, round(seconds_alone / alone))
    return (lambda: [one() for _ in range(rounds)]), stream, rounds * src.numel(), rounds * alone, src, dst


def test_copies_longer_than_the_launch_queue_holds_of_the_loop_are_covered(loop):
    # The driver holds about 70 of the model's steps in its launch queue (190 ms on the
    # H200): a loop enqueued from the caller's thread before copies of half a second
    # blocked it until the loop's last steps, and no loop length covered them.
    enqueue, stream, moved, alone, src, dst = copies(0.5)
    assert alone > 100 * loop.step_seconds
    dst.fill_(0xA5)
    torch.cuda.synchronize()
    got = loop.beside(stream, enqueue, moved, alone)
    assert got is not None, "the loop did not cover the copies"
    assert got.steps_in_window >= 0.5 * alone / loop.step_seconds
    assert got.dry_steps <= 0.02 * got.steps_in_window  # the loop's thread kept ahead of the GPU
    assert 0.2 * moved / alone / 1e9 < got.gb_per_s < 5 * moved / alone / 1e9
    torch.cuda.synchronize()
    assert torch.equal(dst, src)  # every copy ran, once the loop had gone


def test_a_failing_copy_enqueue_is_raised_after_the_loop_is_enqueued(loop):
    stream = torch.cuda.Stream()

    def fail():
        raise RuntimeError("enqueue failed")

    with pytest.raises(RuntimeError, match="enqueue failed"):
        loop.beside(stream, fail, 1 << 20, 0.01)
    torch.cuda.synchronize()
    assert len(loop._steps(3)) == 3  # the loop still runs
