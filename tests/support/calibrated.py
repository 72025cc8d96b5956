"""GPU tests that take method="auto" need a calibration, and a real one takes minutes on
the meter. This fixture (autouse where imported) points kvoffload at a file shared by
the test processes of this host and, where it holds no entry for the device, has it
measured on short windows: seconds, once per host (the calibration's lock keeps
concurrent test processes to one measurement)."""

import os
import pathlib
import tempfile

import pytest

from kvoffload.costs import calibration

PATH = pathlib.Path(tempfile.gettempdir()) / f"kvoffload-test-calibration-{os.getuid()}.json"


@pytest.fixture(autouse=True)
def quick_calibration(monkeypatch):
    monkeypatch.setenv("KVOFFLOAD_CALIBRATION", str(PATH))
    measure = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda device: measure(
        device, moved=64 << 20, pool=256 << 20, steps=20, rounds=1, margin=6))
