"""kvoffload.meter and the bulk copies on a GPU: the bytes arrive, every source gets its
windows between idle ones, copies cover their windows, and the arguments are checked."""

import pytest
import torch

from kvoffload import compute_loop, meter
from kvoffload.steady_copies import BulkCopies


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
