"""kvoffload.calibration without a GPU: the cache file, its lock and atomic writes, and
interpolation; measuring is stood in for."""

import dataclasses
import json
import multiprocessing
import os

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload import calibration
from kvoffload.calibration import Calibration


def fake(key):
    sizes = calibration.SIZES
    return Calibration(key, sizes, {"batch h2d scattered": [float(i + 1) for i in range(len(sizes))]},
                       calibration.BESIDE_SIZES, {"batch h2d": [1.0, 2.0, 3.0]}, {"batch h2d": [0.0, 0.01, 0.02]})


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """One fake GPU per device index; measuring counts its calls."""
    measured = []
    monkeypatch.setenv("KVOFFLOAD_CALIBRATION", str(tmp_path / "calibration.json"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(calibration, "device_key", lambda d: f"fake GPU {d}")
    monkeypatch.setattr(calibration, "measure", lambda d: measured.append(d) or fake(f"fake GPU {d}"))
    monkeypatch.setattr(calibration, "_cached", {})
    return tmp_path / "calibration.json", measured


def test_measured_once_per_device_then_cached_and_read_back(machine, monkeypatch):
    file, measured = machine
    first = calibration.calibration(1)
    assert calibration.calibration(1) is first and measured == [1]
    calibration.calibration()  # the current device, 0
    assert measured == [1, 0]
    entries = json.loads(file.read_text())
    assert set(entries) == {"fake GPU 0", "fake GPU 1"} and entries["fake GPU 1"]["format"] == calibration.FORMAT
    monkeypatch.setattr(calibration, "_cached", {})
    assert calibration.calibration(1) == first and measured == [1, 0]  # from the file
    calibration.calibration(1, recalibrate=True)
    assert measured == [1, 0, 1]


def test_an_entry_of_an_older_format_is_measured_again(machine):
    file, measured = machine
    file.write_text(json.dumps({"fake GPU 0": dataclasses.asdict(fake("fake GPU 0"))}))
    calibration.calibration(0)
    assert measured == [0]


def test_a_write_replaces_the_file_whole(machine, monkeypatch):
    file, _ = machine
    file.write_text(json.dumps({"other GPU": {"format": 1}}))
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: replaced.append((a, b)) or real(a, b))
    calibration.calibration(0)
    assert len(replaced) == 1 and replaced[0][1] == file
    assert set(json.loads(file.read_text())) == {"other GPU", "fake GPU 0"}
    assert [p.name for p in file.parent.iterdir() if p.suffix == ".tmp"] == []


def _hold_the_lock(file, ready, release):
    with calibration._file_lock(file):
        ready.set()
        release.wait(30)


def test_the_file_lock_makes_another_process_wait(tmp_path):
    file = tmp_path / "calibration.json"
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_the_lock, args=(file, ready, release))
    holder.start()
    assert ready.wait(30)
    let_go = ctx.Event()
    let_go.set()  # the waiter lets go as soon as it holds the lock
    waiter = ctx.Process(target=_hold_the_lock, args=(file, ctx.Event(), let_go))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # blocked on the lock
    release.set()
    holder.join(30)
    waiter.join(30)
    assert waiter.exitcode == 0


def test_interpolation_is_logarithmic_and_clamped():
    cal = fake("x")
    assert cal.rate("batch", "h2d", "scattered", 8 << 10) == pytest.approx(1.5)
    assert cal.rate("batch", "h2d", "scattered", 1) == 1 and cal.rate("batch", "h2d", "scattered", 1 << 40) == 6
    assert cal.slowdown_of("batch", "h2d", 2 << 20) == pytest.approx(0.02)
    assert cal.rate_beside("batch", "h2d", 16 << 10) == pytest.approx(1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_without_a_gpu_it_raises_no_cuda_device():
    with pytest.raises(kv.NoCudaDeviceError):
        calibration.calibration()


def test_the_command_line_wants_recalibrate():
    with pytest.raises(SystemExit, match="usage"):
        calibration.main([])
    with pytest.raises(SystemExit, match="usage"):
        calibration.main(["--recalibrate", "--devices", "1"])


@pytest.mark.parametrize("seed", range(5))
def test_a_point_beside_the_loop_keeps_the_window_that_slowed_it_least(seed):
    rng = np.random.default_rng(seed)
    windows = [(float(rate), float(slowdown)) for rate, slowdown in rng.uniform(-0.05, 50, (3, 2))]
    assert calibration.least_slowdown(windows) == min(windows, key=lambda w: w[1])
    dry = [(9.0, None)] + windows  # a window where the loop ran dry measured no slowdown
    assert calibration.least_slowdown(dry) == min(windows, key=lambda w: w[1])
    assert calibration.least_slowdown([(9.0, None), (3.0, None)])[1] is None
