"""method="auto": picks per job among the raw-pointer copy methods (the per-copy loop,
the driver's batch copy, the copy kernel on 8, 4 or 2 CTAs and the staged copy) from
the calibration of the stream's device (kvoffload.copy_methods.CANDIDATES).

A candidate's cost to a model running beside it is its calibrated step slowdown at the
job's mean copy size over bulk copies' slowdown in the same run, as for
kvoffload.Pages(max_slowdown); among those within ``max_slowdown`` the one fastest beside
the model wins (log-interpolated in size). ``max_slowdown=None`` ignores the model and takes
the fastest alone. The staged copy is calibrated on host runs of RUN_BYTES: a job whose
host side comes in shorter runs is predicted at no more than its rate alone with the
host side scattered, which its DMA of small copies holds it to.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

import numpy as np

from kvoffload import calibration as calibrations
from kvoffload.batch_copy import CopyResult, SrcAccessOrder, copy_arguments, stream_device
from kvoffload.calibration import RUN_BYTES, Calibration
from kvoffload.copy_methods import CANDIDATES, CopyMethod, copy_method
from kvoffload.vocabulary import Direction

METHODS = tuple(CANDIDATES)  # the names a method may be given by
MAX_SLOWDOWN = 0.02


def mean_host_run(host: np.ndarray, sizes: np.ndarray) -> float:
    """Mean bytes per run of copies whose host ranges follow each other, in the order
    given (the planner emits each tensor's sub-blocks of a chunk in address order)."""
    if len(sizes) == 0:
        return 0.0
    runs = 1 + int(np.count_nonzero(host[1:] != host[:-1] + sizes[:-1]))
    return float(sizes.sum()) / runs


def choose(cal: Calibration, direction: Direction | str, copy_bytes: float, host_run_bytes: float,
           max_slowdown: float | None = MAX_SLOWDOWN) -> tuple[str, float]:
    """(method, predicted GB/s) for a job. Where no method is within max_slowdown, the
    one that slows the model least. The method is a name of copy_methods.CANDIDATES."""
    def runs(method):
        return CANDIDATES[method].name == "staged" and host_run_bytes >= RUN_BYTES

    def alone(method):
        return cal.rate(method, direction, "host_runs" if runs(method) else "scattered", copy_bytes)

    if max_slowdown is None:
        best = max(CANDIDATES, key=alone)
        return best, alone(best)

    def beside(method):
        rate = cal.rate_beside(method, direction, copy_bytes)
        short_runs = CANDIDATES[method].name == "staged" and not runs(method)
        return min(rate, alone(method)) if short_runs else rate

    slowdown = {m: cal.over_bulk(m, direction, copy_bytes) for m in CANDIDATES}
    within = [m for m in CANDIDATES if slowdown[m] <= max_slowdown and slowdown[m] != math.inf]
    best = max(within, key=beside) if within else min(CANDIDATES, key=slowdown.get)
    return best, beside(best)


def copy(src, dst, sizes, stream=None, *, direction: Direction | str,
         method: str | CopyMethod = "auto", max_slowdown: float | None = MAX_SLOWDOWN,
         order=SrcAccessOrder.STREAM, registry) -> CopyResult:
    """Copies with ``method`` (a name, or a kvoffload.copy_methods object with its own
    options); "auto" picks one from the calibration of the stream's device (see the
    module doc).

    ``direction``: a Direction, "load" or "store". ``order``: how the
    DMA methods may read the source (the SM methods read in stream order).
    ``registry``: as for kvoffload.batch_copy.
    """
    direction = Direction.parse(direction, "direction")
    check_max_slowdown(max_slowdown)
    if method == "auto":
        method = chosen(src, dst, sizes, stream, direction=direction, max_slowdown=max_slowdown,
                        registry=registry)
    return copy_method(method)(src, dst, sizes, stream, direction=direction, order=order, registry=registry)


def chosen(src, dst, sizes, stream=None, *, direction: Direction | str,
           max_slowdown: float | None = MAX_SLOWDOWN, registry) -> str:
    """The name of the candidate (copy_methods.CANDIDATES) that copy(..., method="auto")
    takes for these copies; copy(..., method=name) copies with it."""
    direction = Direction.parse(direction, "direction")
    check_max_slowdown(max_slowdown)
    # Arguments before the device is asked, as each method checks them: the same error.
    _, src, dst, sizes = copy_arguments(registry, src, dst, sizes)
    cal = calibrations.calibration(stream_device(stream))
    host = direction.host_of(src, dst)
    mean = float(sizes.mean()) if len(sizes) else 0.0
    return choose(cal, direction, mean, mean_host_run(host, sizes), max_slowdown)[0]


@dataclasses.dataclass(frozen=True)
class Auto:
    """method="auto" as a copy method object, with its own ``max_slowdown``."""

    max_slowdown: float | None = MAX_SLOWDOWN
    name: ClassVar[str] = "auto"

    def __post_init__(self):
        check_max_slowdown(self.max_slowdown)

    def __call__(self, src, dst, sizes, stream=None, *, direction: Direction | str,
                 order=SrcAccessOrder.STREAM, registry) -> CopyResult:
        return copy(src, dst, sizes, stream, direction=direction, max_slowdown=self.max_slowdown,
                    order=order, registry=registry)


def check_max_slowdown(max_slowdown) -> None:
    """A number >= 0 (numpy's too) or None; not a bool, which JSON configs give for a typo."""
    if max_slowdown is not None and not (isinstance(max_slowdown, numbers.Real) and max_slowdown >= 0
                                         and not isinstance(max_slowdown, (bool, np.bool_))
                                         and _fits_a_float(max_slowdown)):
        raise ValueError(f"max_slowdown: must be a number >= 0 or None, got {max_slowdown!r}")


def _fits_a_float(value) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True
