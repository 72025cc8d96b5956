"""The one rule both calibrations choose by (kvoffload.calibration for method="auto",
kvoffload.page_calibration for Pages(max_slowdown)): of the options whose cost to a model
beside them is within ``max_slowdown``, the fastest, where rates within ``tie`` of it go to
the cheapest; where none is within, the cheapest. An unmeasured (infinite) cost is within
no budget. ``check_max_slowdown`` is what such a budget may be."""

from __future__ import annotations

import math
import numbers
from typing import Callable, Iterable, TypeVar

import numpy as np

Option = TypeVar("Option")


def fastest_within(options: Iterable[Option], cost: Callable[[Option], float], rate: Callable[[Option], float],
                   max_slowdown: float, tie: float = 0.0) -> Option:
    options = list(options)
    within = [o for o in options if cost(o) <= max_slowdown and cost(o) != math.inf]
    if not within:
        return min(options, key=cost)
    fastest = max(rate(o) for o in within)
    return min((o for o in within if rate(o) >= (1 - tie) * fastest), key=cost)


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
