"""kvoffload.registry: regions, the check that every copy stays inside them, and that the
pointer calls and the handler run it."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload.handler import OffloadHandler
from kvoffload.planner import CPUSpec, GPUSpec
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
    ([0x10000, 0x11700], [16, 0x101], "host", r"copies\[1\]: \[0x11700, 0x11801\) is outside registered host memory; nearest region: pool tail"),
    ([0xff00], [0x100], "host", r"copies\[0\]: \[0xff00, 0x10000\) is outside registered host memory"),
    ([0x100000], [16], "host", r"copies\[0\]: .* outside registered host memory"),  # device memory, wrong kind
    ([0x10000], [16], "device", r"nearest region: layer 0"),
])
def test_a_copy_outside_names_its_index_and_the_region_it_missed(addresses, sizes, kind, message):
    with pytest.raises(ValueError, match=message):
        registry().check(addresses, sizes, kind)


def test_nothing_registered_of_a_kind():
    r = MemoryRegistry()
    r.register("pool", 0x10000, 0x1000, "host")
    with pytest.raises(ValueError, match=r"no region of device memory is registered"):
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


def host_pair(rng, n=4096):
    src = rng.integers(0, 256, n, dtype=np.uint8)
    return src, np.full(n, 0xA5, np.uint8)


def registered(src, dst):
    r = MemoryRegistry()
    r.register("src", src.ctypes.data, src.nbytes, "host")
    r.register("dst", dst.ctypes.data, dst.nbytes, "host")
    return r


def test_the_pointer_calls_check_every_copy_before_copying_any():
    rng = np.random.default_rng(0)
    src, dst = host_pair(rng)
    r = registered(src, dst)
    s = np.array([0, 100, 3900], np.int64) + src.ctypes.data
    d = np.array([0, 200, 4000], np.int64) + dst.ctypes.data
    with pytest.raises(ValueError, match=r"dst\[2\]: .* outside registered host memory; nearest region: dst"):
        kv.host_copy(s, d, [16, 16, 97], registry=r)  # one byte past dst's end
    assert (dst == 0xA5).all()
    kv.host_copy(s, d, [16, 16, 96], registry=r)
    np.testing.assert_array_equal(dst[200:216], src[100:116])
    np.testing.assert_array_equal(dst[4000:], src[3900:3996])


def test_the_staged_copy_checks_each_side_for_its_kind():
    rng = np.random.default_rng(1)
    src, dst = host_pair(rng)
    with pytest.raises(ValueError, match=r"dst\[0\]: .* outside registered device memory; no region of device"):
        kv.staged_copy([src.ctypes.data], [dst.ctypes.data], [16], True, registry=registered(src, dst))
    assert (dst == 0xA5).all()


@pytest.mark.parametrize("registry,message", [
    (None, r"registry: expected a MemoryRegistry or kvoffload.UNCHECKED, got NoneType"),
    ("unchecked", r"registry: expected a MemoryRegistry or kvoffload.UNCHECKED, got str"),
])
def test_the_registry_argument_is_required_and_typed(registry, message):
    src, dst = host_pair(np.random.default_rng(2))
    for copy in (kv.host_copy, kv.batch_copy, kv.kernel_copy):
        with pytest.raises(TypeError, match=message):
            copy([src.ctypes.data], [dst.ctypes.data], [16], registry=registry)
        with pytest.raises(TypeError, match=r"registry"):
            copy([src.ctypes.data], [dst.ctypes.data], [16])
    assert (dst == 0xA5).all()


def test_sizes_that_would_overflow_are_outside():
    r = registry()
    with pytest.raises(ValueError, match=r"copies\[0\]"):
        r.check([0x10000], [2**63 - 1], "host")
    with pytest.raises(ValueError, match=r"copies\[0\]"):
        r.check([0x10000], [0], "host")


def test_the_handler_checks_every_job_against_its_registry():
    gpu = [[torch.zeros((8, 256), dtype=torch.uint8) for _ in range(2)]]
    handler = OffloadHandler(gpu, 4, 2)
    assert [r.name for r in handler.registry.regions] == ["gpu_tensors[0][0]", "gpu_tensors[0][1]", "host pool"]
    # A registry that lacks the pool's last chunk stands for a plan that escapes the pool.
    chunk = 2 * 256 * 2
    shrunk = MemoryRegistry()
    for region in handler.registry.regions:
        nbytes = region.nbytes - chunk if region.name == "host pool" else region.nbytes
        shrunk.register(region.name, region.start, nbytes, region.kind)
    handler.registry = shrunk
    handler.pool.tensor.fill_(0xA5)
    with pytest.raises(ValueError, match=r"dst\[0\]: .* outside registered host memory; nearest region: host pool"):
        handler.transfer_async("escapes", GPUSpec([0, 1], [2], [0]), CPUSpec([3]))
    assert (handler.pool.tensor == 0xA5).all() and handler.get_finished() == []
    assert handler.transfer_async("inside", GPUSpec([0, 1], [2], [0]), CPUSpec([2]))
    handler.wait(["inside"])
    assert handler.get_finished()[0].success
    handler.shutdown()
