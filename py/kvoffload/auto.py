"""method="auto": picks per job among the per-copy loop, the driver's batch copy, the
copy kernel and the staged copy, from a calibration measured on this machine.

The calibration times every method at block sizes from 4 KiB to 2 MiB, in both
directions, with the host side scattered and in large runs. It is cached in a JSON
file keyed by GPU, driver and PCIe link ($KVOFFLOAD_CALIBRATION, else
~/.cache/kvoffload/calibration.json) and measured again by

    python -m kvoffload.auto --recalibrate

A job's rate under each method is read off the table at the job's mean copy size
(log-interpolated); the staged copy's from the host-runs table when the job's host
side comes in runs of at least RUN_BYTES, else from the scattered one. Methods that
use more CTAs than the caller's SM budget are left out; budget 0 leaves the DMA-only
methods.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np

from kvoffload.batch_copy import (CopyResult, NoCudaDeviceError, SrcAccessOrder, batch_copy, kernel_copy,
                                  staged_copy)
from kvoffload.registry import UNCHECKED

METHODS = ("per_copy", "batch", "kernel", "staged")
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
PATTERNS = ("scattered", "host_runs")
RUN_BYTES = 256 << 10
KERNEL_CTAS = 8
STAGED_CTAS = 8
CTAS = {"per_copy": 0, "batch": 0, "kernel": KERNEL_CTAS, "staged": STAGED_CTAS}


def calibration_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVOFFLOAD_CALIBRATION",
                                       pathlib.Path.home() / ".cache/kvoffload/calibration.json"))


@functools.cache
def machine_key() -> str:
    """GPU name, driver and PCIe link, as nvidia-smi reports them (asked once)."""
    import torch

    fields = "driver_version,pcie.link.gen.max,pcie.link.width.max"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader",
                              "-i", str(torch.cuda.current_device())],
                             capture_output=True, text=True, check=True).stdout.strip()
        driver, gen, width = (f.strip() for f in out.split(","))
        link = f"PCIe gen{gen} x{width}"
    except (OSError, subprocess.CalledProcessError, ValueError):
        driver, link = "unknown driver", "unknown link"
    return f"{torch.cuda.get_device_name()} | driver {driver} | {link}"


def run_method(method, src, dst, sizes, stream, direction, order=SrcAccessOrder.STREAM, *, registry):
    if method == "per_copy":
        return batch_copy(src, dst, sizes, stream, order=order, per_copy=True, registry=registry)
    if method == "batch":
        return batch_copy(src, dst, sizes, stream, order=order, registry=registry)
    if method == "kernel":
        return kernel_copy(src, dst, sizes, stream, max_ctas=KERNEL_CTAS, registry=registry)
    if method == "staged":
        return staged_copy(src, dst, sizes, direction == "h2d", stream, max_ctas=STAGED_CTAS,
                           registry=registry)
    raise ValueError(f"method: expected one of {METHODS} or 'auto', got {method!r}")


@dataclasses.dataclass
class Calibration:
    key: str
    sizes: list[int]
    rates: dict[str, list[float]]  # "method direction pattern" -> GB/s per size

    def rate(self, method: str, direction: str, pattern: str, copy_bytes: float) -> float:
        table = self.rates[f"{method} {direction} {pattern}"]
        x = np.log2(np.clip(copy_bytes, self.sizes[0], self.sizes[-1]))
        return float(np.interp(x, np.log2(self.sizes), table))


def calibrate(moved: int = 256 << 20, pool: int = 1 << 30) -> Calibration:
    """Times every method on this GPU; takes some seconds."""
    import torch

    rng = np.random.default_rng(0)
    host = torch.empty(pool, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(pool, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    rates = {}
    for pattern in PATTERNS:
        for direction in ("h2d", "d2h"):
            for method in METHODS:
                table = []
                for block in SIZES:
                    n = moved // block
                    g = rng.permutation(pool // block)[:n].astype(np.int64) * block + device.data_ptr()
                    if pattern == "scattered":
                        h = rng.permutation(pool // block)[:n].astype(np.int64) * block
                    else:
                        per_run = max(1, RUN_BYTES // block)
                        runs = rng.permutation(pool // (per_run * block))[: -(-n // per_run)]
                        i = np.arange(n, dtype=np.int64)
                        h = runs[i // per_run].astype(np.int64) * per_run * block + (i % per_run) * block
                    h += host.data_ptr()
                    s, d = (h, g) if direction == "h2d" else (g, h)
                    sizes = np.full(n, block, dtype=np.int64)
                    best = float("inf")
                    for _ in range(2):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        # Addresses made above inside its own buffers.
                        run_method(method, s, d, sizes, stream, direction, registry=UNCHECKED)
                        stream.synchronize()
                        best = min(best, time.perf_counter() - start)
                    table.append(moved / best / 1e9)
                rates[f"{method} {direction} {pattern}"] = table
    return Calibration(machine_key(), SIZES, rates)


_cached: Calibration | None = None


def calibration(recalibrate: bool = False) -> Calibration:
    """This machine's calibration: from the cache file, else measured and saved."""
    global _cached
    import torch

    if not torch.cuda.is_available():
        raise NoCudaDeviceError("method='auto': no CUDA device to calibrate on")
    key = machine_key()
    if _cached is not None and _cached.key == key and not recalibrate:
        return _cached
    path = calibration_path()
    entries = json.loads(path.read_text()) if path.exists() else {}
    if key in entries and not recalibrate:
        _cached = Calibration(**entries[key])
    else:
        _cached = calibrate()
        entries[key] = dataclasses.asdict(_cached)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(entries, indent=1))
    return _cached


def mean_host_run(host: np.ndarray, sizes: np.ndarray) -> float:
    """Mean bytes per run of copies whose host ranges follow each other, in the order
    given (the planner emits each tensor's sub-blocks of a chunk in address order)."""
    if len(sizes) == 0:
        return 0.0
    runs = 1 + int(np.count_nonzero(host[1:] != host[:-1] + sizes[:-1]))
    return float(sizes.sum()) / runs


def choose(cal: Calibration, direction: str, copy_bytes: float, host_run_bytes: float,
           sm_budget: int | None = None) -> tuple[str, float]:
    """(method, predicted GB/s) for a job; sm_budget None means no limit."""
    best = None
    for method in METHODS:
        if sm_budget is not None and CTAS[method] > sm_budget:
            continue
        pattern = "host_runs" if method == "staged" and host_run_bytes >= RUN_BYTES else "scattered"
        rate = cal.rate(method, direction, pattern, copy_bytes)
        if best is None or rate > best[1]:
            best = (method, rate)
    return best


def copy(src, dst, sizes, stream=None, *, direction: str, method: str = "auto",
         sm_budget: int | None = None, order=SrcAccessOrder.STREAM, registry) -> CopyResult:
    """Copies with ``method``; "auto" picks one from the calibration (see the module doc).

    ``direction``: "h2d" or "d2h". ``order`` applies to the batch and per-copy methods;
    the kernel and staged copies read in stream order. ``registry``: as for
    kvoffload.batch_copy.
    """
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction: expected 'h2d' or 'd2h', got {direction!r}")
    if method == "auto":
        sizes = np.asarray(sizes, dtype=np.int64)
        host = np.asarray(src if direction == "h2d" else dst, dtype=np.int64)
        mean = float(sizes.mean()) if len(sizes) else 0.0
        method, _ = choose(calibration(), direction, mean, mean_host_run(host, sizes), sm_budget)
    return run_method(method, src, dst, sizes, stream, direction, order, registry=registry)


if __name__ == "__main__":
    if sys.argv[1:] != ["--recalibrate"]:
        sys.exit("usage: python -m kvoffload.auto --recalibrate")
    cal = calibration(recalibrate=True)
    print(f"{cal.key}: written to {calibration_path()}")
    for name, table in cal.rates.items():
        print(f"{name:<28}" + " ".join(f"{r:6.1f}" for r in table))
