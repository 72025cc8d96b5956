"""kvoffload.costs.auto on a GPU: the calibration file, and auto copies byte for byte."""

import itertools
import json
import math

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload.copy import methods as copy_methods
from kvoffload.costs import cache as calibration_cache
from kvoffload.costs import auto, calibration
from scatter import POISON
from calibrated import quick_calibration  # noqa: F401 - autouse

POOL = 64 << 20


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


def test_calibration_is_measured_on_its_device_once_cached_and_keyed(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("KVOFFLOAD_CALIBRATION", str(path))
    monkeypatch.setattr(calibration_cache, "_cached", {})  # measured on short windows (quick_calibration)
    device = torch.cuda.device_count() - 1
    cal = calibration.calibration(device)
    entry = json.loads(path.read_text())[calibration_cache.device_key(device)]
    assert torch.cuda.get_device_name(device) in cal.key and "driver" in cal.key and "PCIe" in cal.key
    assert set(entry["rates"]) == {f"{m} {d} {p}" for m in copy_methods.CANDIDATES
                                   for d in ("load", "store") for p in calibration.PATTERNS}
    assert all(len(v) == len(calibration.SIZES) and min(v) > 0 for v in entry["rates"].values())
    assert set(entry["beside"]) == set(entry["slowdown"]) == {f"{m} {d}" for m in copy_methods.CANDIDATES
                                                              for d in ("load", "store")}
    assert all(len(v) == len(calibration.BESIDE_SIZES) and min(v) > 0 for v in entry["beside"].values())
    # Fractions of a step, so above -1; no upper bound holds on a GPU the suite's workers share.
    assert set(entry["bulk_slowdown"]) == {"load", "store"}
    assert all(-1 < v < math.inf for v in entry["bulk_slowdown"].values())
    assert all(-1 < v < math.inf for v in itertools.chain(*entry["slowdown"].values()) if v is not None)
    monkeypatch.setattr(calibration_cache, "_cached", {})
    monkeypatch.setattr(calibration, "measure", lambda d: pytest.fail("measured again"))
    assert calibration.calibration(device) == cal


def copy_exactly(direction, block, runs, **copy_options):
    """auto.copy of 16 MiB of block-sized copies (host side in runs or scattered) into a
    poisoned destination; asserts every byte and returns (result, host addresses)."""
    rng = np.random.default_rng(block + runs)
    host_bytes = rng.integers(0, 256, POOL, dtype=np.uint8)
    host = torch.from_numpy(host_bytes.copy()).pin_memory()
    device = torch.from_numpy(rng.integers(0, 256, POOL, dtype=np.uint8)).cuda()
    device_bytes = device.cpu().numpy()
    n = (16 << 20) // block
    h = (np.arange(n) if runs else rng.permutation(POOL // block)[:n]).astype(np.int64) * block
    g = rng.permutation(POOL // block)[:n].astype(np.int64) * block
    (dst_tensor, dst_before, src_bytes) = (device, device_bytes, host_bytes) if direction == "load" else (host, host_bytes, device_bytes)
    dst_tensor.fill_(POISON)
    s, d = (h + host.data_ptr(), g + device.data_ptr()) if direction == "load" else (g + device.data_ptr(), h + host.data_ptr())
    src_off, dst_off = (h, g) if direction == "load" else (g, h)
    registry = kv.MemoryRegistry()
    registry.register_tensor("host", host)
    registry.register_tensor("device", device)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    result = auto.copy(s, d, np.full(n, block), stream, direction=direction, registry=registry, **copy_options)
    stream.synchronize()
    want = np.full(POOL, POISON, np.uint8)
    for so, do in zip(src_off, dst_off):
        want[do : do + block] = src_bytes[so : so + block]
    np.testing.assert_array_equal(dst_tensor.cpu().numpy(), want)
    return result, h + host.data_ptr()


@pytest.mark.parametrize("direction", ["load", "store"])
@pytest.mark.parametrize("block,runs", [(4096, False), (4096, True), (1 << 20, False)])
@pytest.mark.parametrize("max_slowdown", [None, 0.0, 0.02])
def test_auto_copies_are_exact_with_the_method_it_chose(direction, block, runs, max_slowdown):
    result, host_side = copy_exactly(direction, block, runs, max_slowdown=max_slowdown)
    n = (16 << 20) // block
    chosen, _ = calibration.calibration().choose(direction, block, auto.mean_host_run(host_side, np.full(n, block)),
                                                 max_slowdown)
    assert result.path == copy_methods.copy_method(chosen).name  # the paths are named as the methods


@pytest.mark.parametrize("direction", ["load", "store"])
@pytest.mark.parametrize("method", [copy_methods.PerCopy(), copy_methods.Batch(), copy_methods.Kernel(max_ctas=2),
                                    copy_methods.Staged(slot_bytes=1 << 20, slots=2, max_ctas=3)],
                         ids=lambda m: repr(m))
def test_a_method_object_copies_exactly_with_its_own_options(direction, method):
    result, _ = copy_exactly(direction, 4096, True, method=method)
    assert result.path == method.name
