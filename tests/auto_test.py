"""kvoffload.auto without a GPU: the choice among methods from a calibration table."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload import auto
from kvoffload.auto import Calibration, choose, mean_host_run

SIZES = auto.SIZES


def table(**rates):
    """A calibration where each 'method direction pattern' runs at the given GB/s per size;
    absent entries run at 1 GB/s."""
    full = {f"{m} {d} {p}": [1.0] * len(SIZES)
            for m in auto.METHODS for d in ("h2d", "d2h") for p in auto.PATTERNS}
    full.update({k.replace("__", " "): v for k, v in rates.items()})
    return Calibration("test machine", SIZES, full)


def test_picks_the_fastest_method_at_the_job_size():
    cal = table(batch__h2d__scattered=[2, 5, 40, 50, 54, 55], kernel__h2d__scattered=[30, 44, 48, 50, 50, 50])
    assert choose(cal, "h2d", 4 << 10, 0)[0] == "kernel"
    assert choose(cal, "h2d", 2 << 20, 0)[0] == "batch"
    method, rate = choose(cal, "h2d", 128 << 10, 0)  # between 64 and 256 KiB: log-interpolated
    assert method == "kernel" and rate == pytest.approx(49.0)


def test_staged_uses_the_host_runs_table_only_for_long_runs():
    cal = table(staged__d2h__host_runs=[40] * 6, staged__d2h__scattered=[3] * 6, batch__d2h__scattered=[20] * 6)
    assert choose(cal, "d2h", 4096, auto.RUN_BYTES)[0] == "staged"
    assert choose(cal, "d2h", 4096, auto.RUN_BYTES - 1)[0] == "batch"


def test_an_sm_budget_leaves_out_methods_that_need_more_ctas():
    cal = table(kernel__h2d__scattered=[50] * 6, staged__h2d__host_runs=[45] * 6, per_copy__h2d__scattered=[2] * 6)
    assert choose(cal, "h2d", 4096, 8 << 20)[0] == "kernel"
    assert choose(cal, "h2d", 4096, 8 << 20, sm_budget=auto.KERNEL_CTAS - 1)[0] == (
        "staged" if auto.STAGED_CTAS < auto.KERNEL_CTAS else "per_copy")
    assert choose(cal, "h2d", 4096, 8 << 20, sm_budget=0)[0] == "per_copy"


def test_sizes_outside_the_table_take_its_ends():
    cal = table(batch__h2d__scattered=[2, 5, 40, 50, 54, 55])
    assert choose(cal, "h2d", 64, 0)[1] == 2 and choose(cal, "h2d", 1 << 30, 0)[1] == 55


def test_mean_host_run_counts_ranges_that_follow_each_other_in_order():
    host = np.array([0, 100, 200, 1000, 1100, 50], dtype=np.int64)
    sizes = np.full(6, 100, dtype=np.int64)
    assert mean_host_run(host, sizes) == 600 / 3  # [0, 300), [1000, 1200), [50, 150)
    assert mean_host_run(np.zeros(0, np.int64), np.zeros(0, np.int64)) == 0


def test_bad_method_or_direction_raise_before_copying():
    with pytest.raises(ValueError, match=r"direction: expected 'h2d' or 'd2h'"):
        auto.copy([1], [2], [3], direction="up", method="batch", registry=kv.UNCHECKED)
    with pytest.raises(ValueError, match=r"method: expected one of"):
        auto.copy([1], [2], [3], direction="h2d", method="fastest", registry=kv.UNCHECKED)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_auto_without_a_gpu_raises_no_cuda_device():
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 256, 4096, dtype=np.uint8), np.full(4096, 0xA5, np.uint8)
    for direction in ("h2d", "d2h"):
        with pytest.raises(kv.NoCudaDeviceError, match=r"method='auto': no CUDA device"):
            auto.copy([src.ctypes.data], [dst.ctypes.data], [4096], direction=direction, registry=kv.UNCHECKED)
    assert (dst == 0xA5).all()
