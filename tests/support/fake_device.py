"""A calibration cache on a machine without a GPU: torch says there is one, devices are
keyed "fake GPU N", and measuring is stood in for."""

import torch

from kvoffload.costs import cache as calibration_cache


def fake_device(tmp_path, monkeypatch, module, make, suffix=""):
    """(cache file, devices measured): ``module.measure(d)`` records d and returns make(key)."""
    measured = []
    monkeypatch.setenv("KVOFFLOAD_CALIBRATION", str(tmp_path / "calibration.json"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(calibration_cache, "device_key", lambda d: f"fake GPU {d}")
    monkeypatch.setattr(module, "measure", lambda d: measured.append(d) or make(f"fake GPU {d}{suffix}"))
    monkeypatch.setattr(calibration_cache, "_cached", {})
    return tmp_path / "calibration.json", measured
