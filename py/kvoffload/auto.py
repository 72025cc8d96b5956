"""method="auto": picks per job among the raw-pointer copy methods (the per-copy loop,
the driver's batch copy, the copy kernel and the staged copy) from the calibration of
the stream's device (kvoffload.calibration).

A method's cost to a model running beside it is its calibrated step slowdown at the
job's mean copy size; among the methods within ``max_slowdown`` the one fastest beside
the model wins (log-interpolated in size). ``max_slowdown=None`` ignores the model and
takes the fastest alone, the staged copy read off the host-runs table when the job's
host side comes in runs of at least RUN_BYTES, the others off the scattered one.
"""

from __future__ import annotations

import math

import numpy as np

from kvoffload import calibration as calibrations
from kvoffload.batch_copy import CopyResult, SrcAccessOrder, copy_arguments, stream_device
from kvoffload.calibration import RUN_BYTES, Calibration
from kvoffload.copy_methods import METHODS as METHOD_OBJECTS
from kvoffload.copy_methods import CopyMethod, copy_method
from kvoffload.vocabulary import Direction

METHODS = tuple(METHOD_OBJECTS)  # the names the calibration measures, each with its defaults
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
    one that slows the model least."""
    if max_slowdown is None:
        def alone(method):
            pattern = "host_runs" if method == "staged" and host_run_bytes >= RUN_BYTES else "scattered"
            return cal.rate(method, direction, pattern, copy_bytes)
        best = max(METHODS, key=alone)
        return best, alone(best)
    slowdown = {m: cal.slowdown_of(m, direction, copy_bytes) for m in METHODS}
    within = [m for m in METHODS if slowdown[m] <= max_slowdown and slowdown[m] != math.inf]
    if not within:
        best = min(METHODS, key=slowdown.get)
    else:
        best = max(within, key=lambda m: cal.rate_beside(m, direction, copy_bytes))
    return best, cal.rate_beside(best, direction, copy_bytes)


def copy(src, dst, sizes, stream=None, *, direction: Direction | str,
         method: str | CopyMethod = "auto", max_slowdown: float | None = MAX_SLOWDOWN,
         order=SrcAccessOrder.STREAM, registry) -> CopyResult:
    """Copies with ``method`` (a name, or a kvoffload.copy_methods object with its own
    options); "auto" picks one from the calibration of the stream's device (see the
    module doc).

    ``direction``: a Direction, or "h2d"/"load" or "d2h"/"store". ``order``: how the
    DMA methods may read the source (the SM methods read in stream order).
    ``registry``: as for kvoffload.batch_copy.
    """
    direction = Direction.parse(direction, "direction")
    if max_slowdown is not None and not max_slowdown >= 0:
        raise ValueError(f"max_slowdown: must be >= 0 or None, got {max_slowdown!r}")
    if method == "auto":
        # Arguments before the device is asked, as each method checks them: the same error.
        _, src, dst, sizes = copy_arguments(registry, src, dst, sizes)
        cal = calibrations.calibration(stream_device(stream))
        host = direction.host_of(src, dst)
        mean = float(sizes.mean()) if len(sizes) else 0.0
        method, _ = choose(cal, direction, mean, mean_host_run(host, sizes), max_slowdown)
    return copy_method(method)(src, dst, sizes, stream, direction=direction, order=order, registry=registry)
