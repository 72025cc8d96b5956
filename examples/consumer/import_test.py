"""kvoffload imported from another workspace copies host memory."""

import numpy as np

import kvoffload


def test_host_copy_from_a_consumer():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 8192, dtype=np.uint8)
    dst = np.full(8192, 0xA5, dtype=np.uint8)
    offsets = np.arange(2, dtype=np.int64) * 4096
    result = kvoffload.host_copy(offsets + src.ctypes.data, offsets[::-1] + dst.ctypes.data,
                                 [4096, 4096], registry=kvoffload.UNCHECKED)
    assert result.path == "host"
    np.testing.assert_array_equal(dst, np.concatenate([src[4096:], src[:4096]]))
