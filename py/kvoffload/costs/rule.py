"""The one rule both calibrations choose by (kvoffload.costs.calibration for method="auto",
kvoffload.costs.page_calibration for Pages(max_slowdown)): of the options whose cost to a model
beside them is within ``max_slowdown``, the fastest, where rates within ``tie`` of it go to
the cheapest; where none is within, the cheapest. An unmeasured (infinite) cost is within
no budget."""

from __future__ import annotations

import math
from typing import Callable, Iterable, TypeVar

Option = TypeVar("Option")


def fastest_within(options: Iterable[Option], cost: Callable[[Option], float], rate: Callable[[Option], float],
                   max_slowdown: float, tie: float = 0.0) -> Option:
    options = list(options)
    within = [o for o in options if cost(o) <= max_slowdown and cost(o) != math.inf]
    if not within:
        return min(options, key=cost)
    fastest = max(rate(o) for o in within)
    return min((o for o in within if rate(o) >= (1 - tie) * fastest), key=cost)
