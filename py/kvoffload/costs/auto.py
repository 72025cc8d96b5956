"""method="auto": picks per job among the raw-pointer copy methods (the per-copy loop,
the driver's batch copy, the copy kernel on 8, 4 or 2 CTAs and the staged copy) from
the calibration of the stream's device (kvoffload.copy.methods.CANDIDATES).

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
from typing import ClassVar

import numpy as np

from ..copy.batch_copy import CopyResult, SrcAccessOrder, copy_arguments, stream_device
from ..copy.methods import CopyMethod, copy_method
from ..util.arguments import check_max_slowdown
from ..util.vocabulary import Direction
from . import calibration as calibrations
from .calibration import MAX_SLOWDOWN


def mean_host_run(host: np.ndarray, sizes: np.ndarray) -> float:
    """Mean bytes per run of copies whose host ranges follow each other, in the order
    given (the planner emits each tensor's sub-blocks of a chunk in address order)."""
    if len(sizes) == 0:
        return 0.0
    runs = 1 + int(np.count_nonzero(host[1:] != host[:-1] + sizes[:-1]))
    return float(sizes.sum()) / runs


def copy(src, dst, sizes, stream=None, *, direction: Direction | str,
         method: str | CopyMethod = "auto", max_slowdown: float | None = MAX_SLOWDOWN,
         order=SrcAccessOrder.STREAM, registry) -> CopyResult:
    """Copies with ``method`` (a name, or a kvoffload.copy.methods object with its own
    options); "auto" picks one from the calibration of the stream's device (see the
    module doc).

    ``direction``: a Direction, "load" or "store". ``order``: how the
    DMA methods may read the source (the SM methods read in stream order).
    ``registry``: as for kvoffload.copy.batch_copy.
    """
    direction = Direction.parse(direction, "direction")
    check_max_slowdown(max_slowdown)
    if method == "auto":
        method = chosen(src, dst, sizes, stream, direction=direction, max_slowdown=max_slowdown,
                        registry=registry)
    return copy_method(method)(src, dst, sizes, stream, direction=direction, order=order, registry=registry)


def chosen(src, dst, sizes, stream=None, *, direction: Direction | str,
           max_slowdown: float | None = MAX_SLOWDOWN, registry) -> str:
    """The name of the candidate (copy.methods.CANDIDATES) that copy(..., method="auto")
    takes for these copies; copy(..., method=name) copies with it."""
    direction = Direction.parse(direction, "direction")
    check_max_slowdown(max_slowdown)
    # Arguments before the device is asked, as each method checks them: the same error.
    _, src, dst, sizes = copy_arguments(registry, src, dst, sizes)
    cal = calibrations.calibration(stream_device(stream))
    host = direction.host_of(src, dst)
    mean = float(sizes.mean()) if len(sizes) else 0.0
    return cal.choose(direction, mean, mean_host_run(host, sizes), max_slowdown)[0]


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
