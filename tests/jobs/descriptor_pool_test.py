"""kvoffload.jobs.descriptor_pool: arrays lent and returned, each at most once."""

import numpy as np
import pytest

from kvoffload.jobs.descriptor_pool import DescriptorPool


def test_arrays_are_reused_and_hold_the_copies():
    rng = np.random.default_rng(0)
    pool = DescriptorPool()
    for _ in range(50):
        n = int(rng.integers(0, 300))
        src, dst, sizes = (rng.integers(1, 1 << 40, n) for _ in range(3))
        array = pool.acquire(src, dst, sizes)
        assert array.shape[1] >= max(n, 64)
        np.testing.assert_array_equal(array[:, :n], np.stack([src, dst, sizes]))
        pool.release(array)
    assert pool.allocated <= 4  # capacities 64, 128, 256, 512


def test_an_array_goes_back_once():
    rng = np.random.default_rng(1)
    pool = DescriptorPool()
    lent = [pool.acquire(*(rng.integers(1, 100, 10) for _ in range(3))) for _ in range(3)]
    pool.release(lent[1])
    with pytest.raises(ValueError, match=r"array: is not on loan from this pool \(released twice\?\)"):
        pool.release(lent[1])
    with pytest.raises(ValueError, match=r"array: is not on loan"):
        pool.release(np.zeros((3, 64), np.int64))
    again = pool.acquire(*(rng.integers(1, 100, 10) for _ in range(3)))
    assert again is lent[1] and again is not lent[0] and again is not lent[2]
