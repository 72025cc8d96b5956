"""The checks of numeric arguments that every layer shares: an integer (an int or a numpy
integer, never a bool) and a cost budget (max_slowdown)."""

from __future__ import annotations

import numbers

import numpy as np


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def require_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int; TypeError if it is not one, ValueError outside [minimum,
    maximum]. Both errors name the argument."""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: must be <= {maximum}, got {value}")
    return int(value)


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
