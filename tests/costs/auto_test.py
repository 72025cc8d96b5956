"""kvoffload.costs.auto without a GPU: the choice among methods from a calibration table."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload.copy.methods import CANDIDATES, Kernel, copy_method
from kvoffload.costs import auto, calibration
from kvoffload.costs.auto import mean_host_run
from kvoffload.costs.calibration import Calibration

SIZES = calibration.SIZES
BESIDE = calibration.BESIDE_SIZES
RUNS = calibration.RUN_BYTES  # a job's host side in runs long enough for the staged copy


def table(beside=None, slowdown=None, bulk=None, **rates):
    """A calibration where each 'method direction pattern' runs at the given GB/s per size
    (absent entries at 1 GB/s), and each 'method direction' beside the model at the given
    GB/s and step slowdown per beside-size (absent: 1 GB/s, +50%); bulk copies slow it by
    ``bulk`` per direction (absent: 0)."""
    full = {f"{m} {d} {p}": [1.0] * len(SIZES)
            for m in CANDIDATES for d in ("load", "store") for p in calibration.PATTERNS}
    full.update({k.replace("__", " "): v for k, v in rates.items()})
    pairs = [f"{m} {d}" for m in CANDIDATES for d in ("load", "store")]
    return Calibration("test machine", SIZES, full, BESIDE,
                       {k: (beside or {}).get(k, [1.0] * len(BESIDE)) for k in pairs},
                       {k: (slowdown or {}).get(k, [0.5] * len(BESIDE)) for k in pairs},
                       {"load": 0.0, "store": 0.0, **(bulk or {})})


def test_alone_picks_the_fastest_method_at_the_job_size():
    cal = table(batch__load__scattered=[2, 5, 40, 50, 54, 55], kernel__load__scattered=[30, 44, 48, 50, 50, 50])
    assert cal.choose("load", 4 << 10, 0, max_slowdown=None)[0] == "kernel"
    assert cal.choose("load", 2 << 20, 0, max_slowdown=None)[0] == "batch"
    method, rate = cal.choose("load", 128 << 10, 0, max_slowdown=None)  # log-interpolated
    assert method == "kernel" and rate == pytest.approx(49.0)


def test_alone_staged_uses_the_host_runs_table_only_for_long_runs():
    cal = table(staged__store__host_runs=[40] * 6, staged__store__scattered=[3] * 6, batch__store__scattered=[20] * 6)
    assert cal.choose("store", 4096, RUNS, max_slowdown=None)[0] == "staged"
    assert cal.choose("store", 4096, RUNS - 1, max_slowdown=None)[0] == "batch"


def test_the_fastest_beside_the_model_within_the_slowdown_wins():
    cal = table(beside={"kernel load": [40, 45, 50], "staged load": [30, 44, 52], "batch load": [3, 40, 54]},
                slowdown={"kernel load": [0.05, 0.04, 0.03], "staged load": [0.01, 0.01, 0.01],
                          "batch load": [0.0, 0.0, 0.0]})
    assert cal.choose("load", 4 << 10, RUNS)[0] == "staged"  # the kernel is faster but costs 5%
    assert cal.choose("load", 4 << 10, RUNS, max_slowdown=0.06)[0] == "kernel"
    assert cal.choose("load", 4 << 10, RUNS, max_slowdown=0.005)[0] == "batch"
    assert cal.choose("load", 2 << 20, RUNS) == ("batch", 54)


def test_max_slowdown_is_over_the_bulk_copies_slowdown():
    """Beside a loop that bulk loads slow by 4%, a load method at +5% costs 1 point."""
    slowdown = {"kernel load": [0.05] * 3, "batch load": [0.04] * 3}
    beside = {"kernel load": [45, 48, 50], "batch load": [5, 30, 54]}
    assert table(beside=beside, slowdown=slowdown).choose("load", 4 << 10, 0)[0] == "batch"  # the least costly
    cal = table(beside=beside, slowdown=slowdown, bulk={"load": 0.04})
    assert cal.choose("load", 4 << 10, 0) == ("kernel", 45)
    assert cal.over_bulk("kernel", "load", 4 << 10) == pytest.approx(0.01)
    assert cal.choose("load", 4 << 10, 0, max_slowdown=0.005)[0] == "batch"


def test_the_kernel_on_fewer_ctas_wins_where_only_it_is_within_the_slowdown():
    cal = table(beside={"kernel load": [37, 42, 41], "kernel_ctas2 load": [19, 20, 20], "staged load": [26, 29, 28]},
                slowdown={"kernel load": [0.2, 0.24, 0.29], "kernel_ctas2 load": [0.016, 0.02, 0.03],
                          "staged load": [0.095, 0.05, 0.017]})
    assert cal.choose("load", 4 << 10, 0) == ("kernel_ctas2", 19)
    assert cal.choose("load", 4 << 10, RUNS, max_slowdown=0.1)[0] == "staged"
    assert cal.choose("load", 4 << 10, 0, max_slowdown=0.1)[0] == "kernel_ctas2"  # staged: 1 GB/s scattered
    assert cal.choose("load", 2 << 20, RUNS)[0] == "staged"  # 2 CTAs cost 3% there


def test_staged_is_predicted_at_no_more_than_its_scattered_rate_for_short_host_runs():
    # Calibrated beside the model on host runs; a job scattered on the host side moves
    # its slices by DMA of small copies, which its rate alone measures.
    cal = table(staged__load__scattered=[4.5] * 6, staged__load__host_runs=[28] * 6,
                beside={"staged load": [26] * 3, "batch load": [9] * 3},
                slowdown={"staged load": [0.01] * 3, "batch load": [0.015] * 3})
    assert cal.choose("load", 4 << 10, RUNS) == ("staged", 26)
    assert cal.choose("load", 4 << 10, RUNS - 1) == ("batch", 9)
    assert cal.choose("load", 4 << 10, 0, max_slowdown=0.012) == ("staged", 4.5)


def test_chosen_reads_the_job_size_and_host_runs_off_the_copies(monkeypatch):
    cal = table(staged__store__scattered=[4.5] * 6, staged__store__host_runs=[28] * 6,
                beside={"staged store": [26] * 3, "batch store": [9, 30, 50]},
                slowdown={"staged store": [0.01] * 3, "batch store": [0.015] * 3})
    monkeypatch.setattr(calibration, "calibration", lambda device: cal)
    monkeypatch.setattr(auto, "stream_device", lambda stream: 0)
    rng = np.random.default_rng(7)
    gpu = (1 << 36) + rng.permutation(1 << 16).astype(np.int64) * 4096
    runs = (1 << 40) + np.arange(1 << 16, dtype=np.int64) * 4096
    scattered = (1 << 40) + rng.permutation(1 << 16).astype(np.int64) * 4096
    sizes = np.full(1 << 16, 4096)
    assert auto.chosen(gpu, runs, sizes, direction="store", registry=kv.UNCHECKED) == "staged"
    assert auto.chosen(gpu, scattered, sizes, direction="store", registry=kv.UNCHECKED) == "batch"
    assert auto.chosen(gpu, scattered, sizes * 16, direction="store", registry=kv.UNCHECKED,
                       max_slowdown=0.012) == "staged"  # the only one within, however slow
    assert auto.chosen(gpu, runs, sizes, direction="store", registry=kv.UNCHECKED,
                       max_slowdown=np.float32(0.02)) == "staged"  # numpy numbers are numbers
    # The mean copy: 4 KiB copies with one of 2 GiB are 36 KiB on average (batch: 36
    # GB/s), not 2 GiB (50 GB/s) or 4 KiB (9 GB/s).
    mixed = sizes.copy()
    mixed[0] = 2 << 30
    cal.beside["batch store"] = [9, 30, 50]
    cal.slowdown["batch store"] = [0.0] * 3
    assert cal.choose("store", mixed.mean(), 0)[1] < 40
    monkeypatch.setattr(Calibration, "choose", lambda cal, direction, copy_bytes, runs, slowdown: (str(copy_bytes), 0))
    assert auto.chosen(gpu, scattered, mixed, direction="store", registry=kv.UNCHECKED) == str(mixed.mean())
    for bad in (float("nan"), -0.01, "2%", np.float32(-1), True, np.bool_(False)):
        with pytest.raises(ValueError, match="max_slowdown: must be a number >= 0 or None"):
            auto.chosen(gpu, runs, sizes, direction="store", registry=kv.UNCHECKED, max_slowdown=bad)


def test_sizes_where_a_copy_stalled_beside_the_model_leave_its_slowdown_to_the_others():
    # The batch copy's 4 KiB loads stall on host enqueueing beside the model: no slowdown
    # was measured there, so 32 KiB takes the 64 KiB figure, not a mix with a sentinel.
    stalled = [None, 0.004, 0.0]
    cal = table(beside={"batch load": [0.1, 52, 55], "staged load": [26, 30, 30]},
                slowdown={"batch load": stalled, "staged load": [0.01] * 3, "kernel store": [None] * 3})
    assert cal.slowdown_of("batch", "load", 32 << 10) == pytest.approx(0.004)
    assert cal.rate_beside("batch", "load", 32 << 10) == 52  # nor the stalled rate
    for near_the_stall in (1 << 10, 4 << 10, 8 << 10, 16 << 10):  # 16 KiB: as near 4 KiB as 64
        assert cal.slowdown_of("batch", "load", near_the_stall) == float("inf")
    assert cal.slowdown_of("kernel", "store", 32 << 10) == float("inf")
    assert cal.choose("load", 32 << 10, RUNS) == ("batch", 52)
    assert cal.choose("load", 4 << 10, RUNS)[0] == "staged"  # where batch stalls it is not within
    assert cal.choose("load", 4 << 10, RUNS, max_slowdown=float("inf"))[0] == "staged"
    cal.slowdown = {k: [None] * 3 if k == "kernel store" else [0.3] * 3 for k in cal.slowdown}
    assert cal.choose("store", 32 << 10, 0)[0] != "kernel"  # never measured: not the gentlest


def test_a_stall_between_measured_sizes_rules_out_only_the_sizes_nearest_it():
    cal = table(beside={"batch store": [40, 0.1, 55]}, slowdown={"batch store": [0.001, None, 0.001]})
    assert cal.slowdown_of("batch", "store", 64 << 10) == float("inf")
    assert cal.slowdown_of("batch", "store", 8 << 10) == pytest.approx(0.001)
    assert cal.rate_beside("batch", "store", 8 << 10) > 40  # between 40 and 55, not toward 0.1
    assert cal.choose("store", 64 << 10, 0)[0] != "batch"


def test_with_no_method_within_the_slowdown_the_gentlest_wins():
    for gentlest in CANDIDATES:
        cal = table(slowdown={f"{m} store": [0.05 if m == gentlest else 0.1] * 3 for m in CANDIDATES})
        assert cal.choose("store", 16 << 10, 0)[0] == gentlest


def test_every_candidate_is_a_method_name():
    assert copy_method("kernel_ctas2") == Kernel(max_ctas=2) and copy_method("kernel_ctas4") == Kernel(max_ctas=4)
    cal = table(kernel_ctas4__load__scattered=[60] * 6)
    assert cal.choose("load", 4 << 10, 0, max_slowdown=None) == ("kernel_ctas4", 60)


def test_sizes_outside_the_table_take_its_ends():
    cal = table(batch__load__scattered=[2, 5, 40, 50, 54, 55])
    assert cal.choose("load", 64, 0, max_slowdown=None)[1] == 2
    assert cal.choose("load", 1 << 30, 0, max_slowdown=None)[1] == 55


def test_mean_host_run_counts_ranges_that_follow_each_other_in_order():
    host = np.array([0, 100, 200, 1000, 1100, 50], dtype=np.int64)
    sizes = np.full(6, 100, dtype=np.int64)
    assert mean_host_run(host, sizes) == 600 / 3  # [0, 300), [1000, 1200), [50, 150)
    assert mean_host_run(np.zeros(0, np.int64), np.zeros(0, np.int64)) == 0


def test_bad_method_or_direction_raise_before_copying():
    with pytest.raises(ValueError, match=r"direction: expected one of \('load', 'store'\), got 'up'"):
        auto.copy([1], [2], [3], direction="up", method="batch", registry=kv.UNCHECKED)
    with pytest.raises(ValueError, match=r"method: expected one of"):
        auto.copy([1], [2], [3], direction="load", method="fastest", registry=kv.UNCHECKED)
    with pytest.raises(ValueError, match=r"max_slowdown: must be a number >= 0 or None"):
        auto.copy([1], [2], [3], direction="load", max_slowdown=-0.1, registry=kv.UNCHECKED)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_auto_without_a_gpu_raises_no_cuda_device():
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 256, 4096, dtype=np.uint8), np.full(4096, 0xA5, np.uint8)
    for direction in ("load", "store"):
        with pytest.raises(kv.NoCudaDeviceError, match=r"no CUDA device"):
            auto.copy([src.ctypes.data], [dst.ctypes.data], [4096], direction=direction, registry=kv.UNCHECKED)
    assert (dst == 0xA5).all()
