"""kvoffload.compute_loop on a GPU: a loop covers copies longer than the driver's launch
queue holds of it, reports steps that found the GPU idle, and raises what the copies
raise."""

import functools

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


def host_to_device(seconds_alone: float, page: int):
    """Back-to-back host-to-device copies of ``page`` bytes each (DMA: a device-to-device
    copy is a kernel, which waits for the model's), random pages of a 64 MiB pool, about
    ``seconds_alone`` long on the stream; (enqueue, stream, bytes, seconds alone, src, dst,
    the same copies in_pieces)."""
    stream = torch.cuda.Stream()
    src = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).pin_memory()
    dst = torch.full((src.numel(),), 0xA5, dtype=torch.uint8, device="cuda")
    pages = np.random.default_rng(page).permutation(src.numel() // page).astype(np.int64) * page
    sizes = np.full(len(pages), page, dtype=np.int64)
    run = lambda s, d, z: kv.batch_copy(s, d, z, stream, per_copy=True, registry=kv.UNCHECKED)
    one = functools.partial(run, src.data_ptr() + pages, dst.data_ptr() + pages, sizes)
    pieces = compute_loop.in_pieces(run, src.data_ptr() + pages, dst.data_ptr() + pages, sizes)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    one()
    end.record(stream)
    end.synchronize()
    alone = start.elapsed_time(end) / 1e3
    rounds = max(1, round(seconds_alone / alone))
    dst.fill_(0xA5)
    torch.cuda.synchronize()
    return (lambda: [one() for _ in range(rounds)]), stream, rounds * src.numel(), rounds * alone, src, dst, \
        pieces * rounds


def test_copies_longer_than_the_launch_queue_holds_of_the_loop_are_covered(loop):
    # The driver holds about 70 of the model's steps in its launch queue (190 ms on the
    # H200): a loop enqueued whole before half a second of copies blocked the host until
    # its last steps, and no loop length covered them.
    enqueue, stream, moved, alone, src, dst, _ = host_to_device(0.5, 16 << 20)
    assert alone > 100 * loop.step_seconds
    got = loop.beside(stream, enqueue, moved, alone)
    assert got is not None, "the loop did not cover the copies"
    assert got.steps_in_window >= 0.5 * alone / loop.step_seconds
    assert got.dry_steps == 0  # enqueued in microseconds: the loop never waited for the host
    assert 0.5 * moved / alone / 1e9 < got.gb_per_s < 2 * moved / alone / 1e9
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)  # every copy ran


def test_steps_that_found_the_gpu_idle_while_the_host_enqueued_copies_are_counted(loop):
    # 4 KiB copies one driver call each: the host enqueues them about as fast as the link
    # moves them, far longer than the steps enqueued ahead of the GPU last.
    enqueue, stream, moved, alone, src, dst, _ = host_to_device(0.5, 4 << 10)
    got = loop.beside(stream, enqueue, moved, alone)
    assert got is not None and got.dry_steps > 0
    assert got.dry_steps <= got.steps_in_window
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)


def test_the_same_copies_in_pieces_keep_the_loop_fed(loop):
    _, stream, moved, alone, src, dst, pieces = host_to_device(0.5, 4 << 10)
    assert len(pieces) > 1
    got = loop.beside(stream, pieces, moved, alone)
    assert got is not None and got.dry_steps == 0
    assert got.steps_in_window >= 0.25 * alone / loop.step_seconds
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)


def test_a_failing_copy_enqueue_is_raised_and_the_loop_still_runs(loop):
    stream = torch.cuda.Stream()

    def fail():
        raise RuntimeError("enqueue failed")

    with pytest.raises(RuntimeError, match="enqueue failed"):
        loop.beside(stream, fail, 1 << 20, 0.01)
    torch.cuda.synchronize()
    assert len(loop._steps(3)) == 3
