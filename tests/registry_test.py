"""kvoffload.registry: regions, and the check that every copy stays inside them."""

import numpy as np
import pytest
import torch

from kvoffload.registry import MemoryRegistry


def registry():
    r = MemoryRegistry()
    r.register("pool", 0x10000, 0x1000, "host")
    r.register("pool tail", 0x11000, 0x800, "host")  # adjacent: one run of host memory
    r.register("layer 0", 0x100000, 0x4000, "device")
    return r


def test_copies_inside_registered_regions_pass():
    r = registry()
    r.check([0x10000, 0x10ff0, 0x11700], [16, 0x20, 0x100], "host")  # the second spans both
    r.check(np.array([0x100000, 0x103f00]), np.array([0x100, 0x100]), "device")


@pytest.mark.parametrize("addresses,sizes,kind,message", [
    ([0x10000, 0x11700], [16, 0x101], "host", r"copies\[1\]: \[0x11700, 0x11801\) is outside registered host memory; nearest host region: pool tail"),
    ([0xff00], [0x100], "host", r"copies\[0\]: \[0xff00, 0x10000\) is outside registered host memory"),
    ([0x100000], [16], "host", r"copies\[0\]: .* outside registered host memory"),  # device memory, wrong kind
    ([0x10000], [16], "device", r"nearest device region: layer 0"),
])
def test_a_copy_outside_names_its_index_and_the_region_it_missed(addresses, sizes, kind, message):
    with pytest.raises(ValueError, match=message):
        registry().check(addresses, sizes, kind)


def test_nothing_registered_of_a_kind():
    r = MemoryRegistry()
    r.register("pool", 0x10000, 0x1000, "host")
    with pytest.raises(ValueError, match=r"no device region is registered"):
        r.check([0x10000], [1], "device")


def test_bad_registrations():
    r = registry()
    with pytest.raises(ValueError, match=r"kind: expected one of"):
        r.register("x", 1, 1, "managed")
    with pytest.raises(ValueError, match=r"x: needs a positive address and size"):
        r.register("x", 0, 16, "host")
    with pytest.raises(ValueError, match=r"x: overlaps layer 0, registered as device memory"):
        r.register("x", 0x103000, 0x2000, "host")


def test_register_tensor_spans_strided_blocks():
    cache = torch.zeros((2, 8, 64), dtype=torch.float16)
    r = MemoryRegistry()
    r.register_tensor("k", cache[0])
    r.register_tensor("v of block 3..", cache[1, 3:])
    base = cache.data_ptr()
    r.check([base, base + 7 * 128], [128, 128], "host")
    with pytest.raises(ValueError, match=r"copies\[0\]"):
        r.check([base + 8 * 128], [128 * 4], "host")  # blocks 0..2 of v are not registered
