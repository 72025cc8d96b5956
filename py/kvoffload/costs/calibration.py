"""What each raw-pointer copy method achieves on this machine, alone and beside a model.

For every candidate (kvoffload.copy.methods.CANDIDATES: each method with its defaults, and
the copy kernel on fewer CTAs), direction and block size (4 KiB to 2 MiB) it
times the method alone, with the host side scattered and in runs; at a few sizes it
also keeps it in flight beside the loop of kvoffload.meter.CALIBRATION_WORKLOAD and records
its rate there and the loop's step slowdown, with bulk copies' slowdown in the same run.
Measured on the device it describes, cached in a JSON file ($KVOFFLOAD_CALIBRATION, else
~/.cache/kvoffload/calibration.json) under that device's name, driver, PCIe link and
bus id, written atomically under a lock, and measured again by

    python -m kvoffload.costs.calibration --recalibrate [--device N]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from typing import ClassVar

import numpy as np

from ..copy.methods import CANDIDATES
from ..copy.registry import UNCHECKED
from ..util.vocabulary import Direction
from . import cache as calibration_cache
from .cache import increasing, interpolate, numbers
from .rule import fastest_within

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
BESIDE_SIZES = [4 << 10, 64 << 10, 2 << 20]
PATTERNS = ("scattered", "host_runs")
RUN_BYTES = 256 << 10
MAX_SLOWDOWN = 0.02  # method="auto"'s default budget over bulk copies' step slowdown
FORMAT = 13  # entries of another format (13: directions spelt store / load) are measured again


@dataclasses.dataclass
class Calibration:
    key: str
    sizes: list[int]
    rates: dict[str, list[float]]  # "method direction pattern" -> GB/s alone, per size
    beside_sizes: list[int] = dataclasses.field(default_factory=list)
    beside: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "method direction" -> GB/s
    # "method direction" -> step slowdown per beside-size (kvoffload.meter); None where
    # nothing was measured: the copies did not cover their windows, or their host
    # enqueueing outlasted the steps enqueued ahead of them (the loop ran dry beside them).
    slowdown: dict[str, list[float | None]] = dataclasses.field(default_factory=dict)
    # "store" / "load" -> bulk copies' step slowdown in the same run (where beside_sizes).
    bulk_slowdown: dict[str, float] = dataclasses.field(default_factory=dict)
    FORMAT: ClassVar[int] = FORMAT
    MODULE: ClassVar[str] = "kvoffload.costs.calibration"  # whose --recalibrate measures it
    NEEDED_BY: ClassVar[str] = "method='auto'"

    def rate(self, method: str, direction: Direction | str, pattern: str, copy_bytes: float) -> float:
        return interpolate(self.sizes, self.rates[f"{method} {_short(direction)} {pattern}"], copy_bytes)

    def rate_beside(self, method: str, direction: Direction | str, copy_bytes: float) -> float:
        """Interpolated over the sizes where a slowdown was measured (all, if none)."""
        name = f"{method} {_short(direction)}"
        measured = self._measured(name) or self.beside_sizes
        rates = dict(zip(self.beside_sizes, self.beside[name]))
        return interpolate(measured, [rates[size] for size in measured], copy_bytes)

    def slowdown_of(self, method: str, direction: Direction | str, copy_bytes: float) -> float:
        """Interpolated over the sizes where it was measured; inf where the calibrated size
        nearest to copy_bytes (in log scale; of two, either) measured none: host enqueueing
        holds up small copies, and that at 4 KiB says nothing of 32 KiB, where 64 KiB ran."""
        name = f"{method} {_short(direction)}"
        measured = self._measured(name)
        distance = [abs(math.log2(size) - math.log2(max(copy_bytes, 1))) for size in self.beside_sizes]
        nearest = min(distance) if distance else 0.0
        if not measured or any(d == nearest and size not in measured
                               for size, d in zip(self.beside_sizes, distance)):
            return math.inf
        slowdowns = dict(zip(self.beside_sizes, self.slowdown[name]))
        return interpolate(measured, [slowdowns[size] for size in measured], copy_bytes)

    def over_bulk(self, method: str, direction: Direction | str, copy_bytes: float) -> float:
        """slowdown_of less the bulk copies' slowdown in that direction."""
        return self.slowdown_of(method, direction, copy_bytes) - self.bulk_slowdown[_short(direction)]

    def choose(self, direction: Direction | str, copy_bytes: float, host_run_bytes: float,
               max_slowdown: float | None = MAX_SLOWDOWN) -> tuple[str, float]:
        """(method, predicted GB/s) for a job of copies of ``copy_bytes`` on average whose
        host side comes in runs of ``host_run_bytes``: kvoffload.costs.rule's fastest
        within ``max_slowdown`` beside the model; None takes the fastest alone. The method
        is a name of copy.methods.CANDIDATES."""
        def runs(method):
            return CANDIDATES[method].name == "staged" and host_run_bytes >= RUN_BYTES

        def alone(method):
            return self.rate(method, direction, "host_runs" if runs(method) else "scattered", copy_bytes)

        if max_slowdown is None:
            best = max(CANDIDATES, key=alone)
            return best, alone(best)

        def beside(method):
            rate = self.rate_beside(method, direction, copy_bytes)
            short_runs = CANDIDATES[method].name == "staged" and not runs(method)
            return min(rate, alone(method)) if short_runs else rate

        slowdown = {m: self.over_bulk(m, direction, copy_bytes) for m in CANDIDATES}
        best = fastest_within(CANDIDATES, slowdown.get, beside, max_slowdown)
        return best, beside(best)

    def valid(self) -> bool:
        """Whether the fields read from a file make a calibration that choose() can read:
        every candidate's tables, each a rate >= 0 or slowdown per size."""
        pairs = {f"{m} {d.value}" for m in CANDIDATES for d in Direction}
        tables = (self.rates, self.beside, self.slowdown, self.bulk_slowdown)
        return (isinstance(self.key, str) and increasing(self.sizes) and increasing(self.beside_sizes)
                and len(self.sizes) > 0 and len(self.beside_sizes) > 0
                and all(isinstance(t, dict) for t in tables)
                and set(self.rates) == {f"{pair} {p}" for pair in pairs for p in PATTERNS}
                and set(self.beside) == set(self.slowdown) == pairs
                and set(self.bulk_slowdown) == {d.value for d in Direction}
                and all(numbers(t) and len(t) == len(self.sizes) and min(t) >= 0 for t in self.rates.values())
                and all(numbers(t) and len(t) == len(self.beside_sizes) and min(t) >= 0
                        for t in self.beside.values())
                and all(numbers(t, none=True) and len(t) == len(self.beside_sizes)
                        for t in self.slowdown.values())
                and numbers(list(self.bulk_slowdown.values())))

    def _measured(self, name: str) -> list[int]:
        """The beside-sizes where the copies of ``name`` ran inside the loop."""
        return [size for size, s in zip(self.beside_sizes, self.slowdown[name]) if s is not None]


def _short(direction: Direction | str) -> str:
    return Direction.parse(direction, "direction").value


def _offsets(rng, pool, block, n, pattern):
    """n distinct block offsets in a pool: at random, or in runs of RUN_BYTES at random."""
    if pattern == "scattered":
        return rng.permutation(pool // block)[:n].astype(np.int64) * block
    per_run = max(1, RUN_BYTES // block)
    runs = rng.permutation(pool // (per_run * block))[: -(-n // per_run)]
    i = np.arange(n, dtype=np.int64)
    return runs[i // per_run].astype(np.int64) * per_run * block + (i % per_run) * block


def measure(device: int, moved: int = 256 << 20, pool: int = 1 << 30, **windows) -> Calibration:
    """Times every candidate on ``device``: some seconds alone, a few minutes beside.
    windows: kvoffload.meter.measure's steps, rounds and margin (default: its own)."""
    import torch

    from ..meter import compute_loop, meter
    from ..meter.sources import CALL_SECONDS, BulkCopies, RawCopies, in_calls

    with torch.cuda.device(device):
        rng = np.random.default_rng(0)
        host = torch.empty(pool, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(pool, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)

        def run(method, direction):
            # Addresses made below inside its own buffers.
            return functools.partial(CANDIDATES[method], stream=stream, direction=direction, registry=UNCHECKED)

        def batch(direction, block, pattern):
            """(src, dst, sizes) of ``moved`` bytes of block copies."""
            n = moved // block
            g = _offsets(rng, pool, block, n, "scattered") + gpu.data_ptr()
            h = _offsets(rng, pool, block, n, pattern) + host.data_ptr()
            return (*direction.ends(h, g), np.full(n, block, dtype=np.int64))

        def copy(method, direction, block, pattern):
            return functools.partial(run(method, direction), *batch(direction, block, pattern))

        def seconds(copy):
            torch.cuda.synchronize()
            start = time.perf_counter()
            copy()
            stream.synchronize()
            return time.perf_counter() - start

        cal = Calibration(calibration_cache.device_key(device), SIZES, {}, BESIDE_SIZES)
        for pattern in PATTERNS:
            for direction in Direction:
                for method in CANDIDATES:
                    cal.rates[f"{method} {direction.value} {pattern}"] = [
                        moved / min(seconds(copy(method, direction, b, pattern)) for _ in range(2)) / 1e9
                        for b in SIZES]
        loop = compute_loop.ComputeLoop(torch, meter.CALIBRATION_WORKLOAD, f"cuda:{device}")

        def source(method, direction, block):
            pattern = "host_runs" if CANDIDATES[method].name == "staged" else "scattered"
            rate = cal.rates[f"{method} {direction.value} {pattern}"][SIZES.index(block)]
            call_bytes = max(block, int(rate * 1e9 * CALL_SECONDS) // block * block)
            calls = in_calls(run(method, direction), *batch(direction, block, pattern), call_bytes)
            return lambda: RawCopies(torch, calls, stream)

        points = [(m, d, b) for d in Direction for m in CANDIDATES for b in BESIDE_SIZES]
        sources = {point: source(*point) for point in points}
        for direction in Direction:  # made once: its pinned buffers are not allocated inside a window
            bulk = BulkCopies(torch, direction.value, moved, device=f"cuda:{device}")
            sources["bulk", direction, 0] = lambda bulk=bulk: bulk
        got = meter.measure(loop, sources, **windows)
        cal.bulk_slowdown = {d.value: got["bulk", d, 0].step_slowdown for d in Direction}
        for direction in Direction:
            for method in CANDIDATES:
                results = [got[method, direction, b] for b in BESIDE_SIZES]
                cal.beside[f"{method} {direction.value}"] = [r.gb_per_s for r in results]
                # A loop that ran dry waited for the host: its slowdown says nothing.
                cal.slowdown[f"{method} {direction.value}"] = [
                    None if r.dry_steps or not all(w["covered"] for w in r.windows) else r.step_slowdown
                    for r in results]
        return cal


def calibration(device: int | None = None, recalibrate: bool = False) -> Calibration:
    """``device``'s calibration (default: the current device): cached in this process,
    else from the file, else measured on that device and saved. Reading takes no lock
    (the file is replaced whole), so a read-only cache serves; measuring takes it.
    ``recalibrate`` measures again and replaces a file that cannot be read."""
    return calibration_cache.cached(device, "", Calibration, lambda d: measure(d), recalibrate)


def main(argv: list[str]) -> None:
    cal = calibration(calibration_cache.recalibrate_device(argv, "kvoffload.costs.calibration"), recalibrate=True)
    print(f"{cal.key}: written to {calibration_cache.path()}")
    for name, table in cal.rates.items():
        print(f"{name:<31}" + " ".join(f"{r:6.1f}" for r in table))
    if cal.bulk_slowdown:
        print("bulk copies' slowdown: " + ", ".join(f"{d} {v:+.2%}" for d, v in cal.bulk_slowdown.items()))
    for name, table in cal.beside.items():
        print(f"{name + ' beside model':<31}" + " ".join(
            f"{r:6.1f} ({'unmeasured' if s is None else f'{s:+.1%}'})" for r, s in zip(table, cal.slowdown[name])))


if __name__ == "__main__":
    main(sys.argv[1:])
