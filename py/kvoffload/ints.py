"""The one check of an integer argument: an int or a numpy integer, never a bool."""

from __future__ import annotations

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
