"""kvoffload.util.arguments: the one integer check, its types and bounds, each error naming the argument."""

import numpy as np
import pytest

from kvoffload.util.arguments import is_int, require_int


@pytest.mark.parametrize("value", [0, -3, 1 << 70, np.int8(5), np.uint64(7), np.int64(-1)])
def test_ints_and_numpy_integers_are_ints(value):
    assert is_int(value)
    assert require_int("n", value) == int(value) and type(require_int("n", value)) is int


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, np.float32(2), "3", None, [1]])
def test_bools_floats_and_the_rest_are_not(value):
    assert not is_int(value)
    with pytest.raises(TypeError, match=f"^count: expected an int, got {type(value).__name__}$"):
        require_int("count", value)


def test_the_bounds_are_inclusive_and_named():
    rng = np.random.default_rng(5)
    for lo, hi in rng.integers(-100, 100, (20, 2)):
        lo, hi = sorted((int(lo), int(hi)))
        assert require_int("k", lo, lo, hi) == lo and require_int("k", hi, lo, hi) == hi
        with pytest.raises(ValueError, match=f"^k: must be >= {lo}, got {lo - 1}$"):
            require_int("k", lo - 1, lo, hi)
        with pytest.raises(ValueError, match=f"^k: must be <= {hi}, got {hi + 1}$"):
            require_int("k", np.int64(hi + 1), lo, hi)
