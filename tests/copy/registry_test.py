"""kvoffload.copy.registry: regions, the check that every copy stays inside them, and that the
pointer calls and the handler run it."""

import gc
import weakref

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload import _C
from kvoffload.copy.registry import MemoryRegistry
from kvoffload.jobs.handler import OffloadHandler
from kvoffload.pages.planner import CPUSpec, GPUSpec


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
        kv.staged_copy([src.ctypes.data], [dst.ctypes.data], [16], "load", registry=registered(src, dst))
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
        handler.store("escapes", GPUSpec([0, 1], [2], [0]), CPUSpec([3]))
    assert (handler.pool.tensor == 0xA5).all() and handler.get_finished() == []
    assert handler.store("inside", GPUSpec([0, 1], [2], [0]), CPUSpec([2]))
    handler.wait(["inside"])
    assert handler.get_finished()[0].success
    handler.shutdown()


def test_a_registered_tensor_is_kept_alive_until_unregistered():
    rng = np.random.default_rng(3)
    for _ in range(5):
        tensor = torch.from_numpy(rng.integers(0, 256, int(rng.integers(1, 1 << 16)), dtype=np.uint8))
        start, nbytes, alive = tensor.data_ptr(), tensor.numel(), weakref.ref(tensor)
        r = MemoryRegistry()
        r.register_tensor("t", tensor)
        del tensor
        gc.collect()
        assert alive() is not None  # its memory cannot be reused while copies are checked against it
        r.check([start], [nbytes], "host")
        r.unregister("t")
        gc.collect()
        assert alive() is None
        with pytest.raises(ValueError, match=r"no region of host memory is registered"):
            r.check([start], [nbytes], "host")
    with pytest.raises(KeyError, match=r"no region 't' is registered"):
        r.unregister("t")


VIEWS = {  # a view of a random [rows, cols] tensor and the elements it spans
    "expanded": lambda t: t[:, :1].expand(-1, 1000),
    "transposed": lambda t: t.t(),
    "every other column": lambda t: t[:, ::2],
    "one column": lambda t: t[:, 3],
    "broadcast row": lambda t: t[:1].expand(5, -1),
}


@pytest.mark.parametrize("view", VIEWS.keys())
def test_register_tensor_spans_exactly_the_bytes_a_view_reaches(view):
    rng = np.random.default_rng(len(view))
    base = torch.from_numpy(rng.standard_normal((int(rng.integers(2, 9)), 8)).astype(np.float32))
    tensor = VIEWS[view](base)
    offsets = [sum(i * s for i, s in zip(index, tensor.stride())) for index in np.ndindex(*tensor.shape)]
    first, last = tensor.data_ptr(), tensor.data_ptr() + 4 * (max(offsets) + 1)
    r = MemoryRegistry()
    r.register_tensor("view", tensor)
    r.check([first], [last - first], "host")  # every byte the view reaches
    for outside in ([first - 1], [last]):
        with pytest.raises(ValueError, match=r"outside registered host memory"):
            r.check(outside, [1], "host")
    assert r.regions[0].start == first and r.regions[0].end == last


def test_a_copy_may_not_span_adjacent_regions_of_two_kinds():
    rng = np.random.default_rng(4)
    for _ in range(20):
        start, host, device = (int(x) for x in rng.integers(1 << 20, 1 << 30, 3))
        r = MemoryRegistry()
        r.register("host", start, host, "host")
        r.register("device", start + host, device, "device", 0)
        r.register("more host", start + host + device, host, "host")
        r.check([start, start + host], [host, device], None)
        edge = int(rng.integers(1, min(host, device)))
        with pytest.raises(ValueError, match=r"copies\[0\]: .* outside registered memory"):
            r.check([start + host - edge], [2 * edge], None)
        with pytest.raises(ValueError, match=r"copies\[0\]"):
            r.check([start + host + device - edge], [2 * edge], None)


def test_the_error_names_the_copy_as_it_was_checked():
    r = registry()
    start = r.regions[0].start
    # A subclass is copied first (the check and the message read the copy); a plain
    # array is read once, and the message shows what was read.
    masked = np.ma.array([start, 0x10], mask=[False, True], dtype=np.int64)
    with pytest.raises(ValueError, match=r"^copies\[1\]: \[0x10, 0x20\) is outside registered host memory"):
        r.check(masked, [16, 16], "host")
    assert _C.first_copy_outside(np.array([start], np.int64), np.array([start + 64], np.int64),
                                 np.array([start, start + 60], np.int64), np.array([8, 8], np.int64)) == (1, start + 60, 8)
    assert _C.first_copy_outside(np.array([start], np.int64), np.array([start + 64], np.int64),
                                 np.array([start], np.int64), np.array([64], np.int64)) == (-1, 0, 0)


@pytest.mark.parametrize("start,nbytes,error,message", [
    (2**63 - 16, 32, ValueError, r"x: \[0x7ffffffffffffff0, 0x8000000000000010\) ends past 2\^63 - 1"),
    (2**63 - 16, 16, ValueError, r"x: \[0x7ffffffffffffff0, 0x8000000000000000\) ends past 2\^63 - 1"),
    (1, 2**63, ValueError, r"x: .* ends past 2\^63"),
    (2**64, 16, ValueError, r"ends past 2\^63"),
    (4096.0, 16, TypeError, r"start: expected an int, got float"),
    (0x1000, True, TypeError, r"nbytes: expected an int, got bool"),
])
def test_registrations_that_would_break_later_checks_are_refused(start, nbytes, error, message):
    r = registry()
    with pytest.raises(error, match=message):
        r.register("x", start, nbytes, "host")
    r.check([0x10000], [16], "host")  # and the registry still works
    assert [region.name for region in r.regions] == ["pool", "pool tail", "layer 0"]


def test_a_name_is_registered_once_and_devices_do_not_overlap():
    r = registry()
    with pytest.raises(ValueError, match=r"pool: is already registered"):
        r.register("pool", 0x20000, 16, "host")
    r.register("gpu 0", 0x200000, 0x1000, "device", 0)
    with pytest.raises(ValueError, match=r"gpu 1: overlaps gpu 0, registered as device memory of device 0"):
        r.register("gpu 1", 0x200800, 0x1000, "device", 1)


BAD_ARGUMENTS = {  # (src, dst, sizes) as offsets into src and dst; what must be raised
    "zero size": (lambda s, d: ([s], [d], [0]), ValueError, r"sizes\[0\]: must be > 0, got 0"),
    "negative size": (lambda s, d: ([s], [d + 64], [-64]), ValueError, r"sizes\[0\]: must be > 0, got -64"),
    "null src": (lambda s, d: ([s, 0], [d, d + 8], [8, 8]), ValueError, r"src\[1\]: null pointer"),
    "negative dst": (lambda s, d: ([s], [-d], [8]), ValueError, r"dst\[0\]: negative address"),
    "2-D src": (lambda s, d: (np.array([[s]]), [d], [8]), ValueError, r"src: expected a 1-D array, got 2-D"),
    "float size": (lambda s, d: ([s], [d], [8.0]), TypeError, r"sizes\[0\]: expected an int"),
}


@pytest.mark.parametrize("case", BAD_ARGUMENTS.keys())
def test_a_registry_does_not_change_the_argument_errors(case):
    src, dst = host_pair(np.random.default_rng(5))
    change, error, message = BAD_ARGUMENTS[case]
    args = change(src.ctypes.data, dst.ctypes.data)
    for r in (kv.UNCHECKED, registered(src, dst)):
        with pytest.raises(error, match=message):
            kv.host_copy(*args, registry=r)
    assert (dst == 0xA5).all()


class Shifting(list):
    """A sequence of ints that reads differently each time it is read."""

    def __init__(self, first, later):
        super().__init__(first)
        self.later = later
        self.reads = 0

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i) if self.reads <= len(self) else self.later[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __array__(self, dtype=None, copy=None):
        return np.array([self[i] for i in range(len(self))], dtype=dtype)


def test_the_arrays_checked_are_the_arrays_copied():
    rng = np.random.default_rng(6)
    src, dst = host_pair(rng)
    unregistered = np.full(4096, 0xA5, np.uint8)
    r = registered(src, dst)
    offsets = rng.integers(0, 4096 - 64, 8)
    inside = (offsets + dst.ctypes.data).tolist()
    outside = (offsets + unregistered.ctypes.data).tolist()
    kv.host_copy((offsets + src.ctypes.data).tolist(), Shifting(inside, outside), [64] * 8, registry=r)
    assert (unregistered == 0xA5).all()
    for o in offsets:
        np.testing.assert_array_equal(dst[o:o + 64], src[o:o + 64])


@pytest.mark.parametrize("swap", ["set_", "resize_", "data"])
def test_a_checked_copy_into_a_tensor_whose_storage_was_swapped_is_refused(swap):
    rng = np.random.default_rng(60)
    src = torch.from_numpy(rng.integers(0, 256, 4096, dtype=np.uint8))
    dst = torch.full((4096,), 0xA5, dtype=torch.uint8)
    r = MemoryRegistry()
    r.register_tensor("src", src)
    r.register_tensor("dst", dst)
    address = dst.data_ptr()
    kv.host_copy([src.data_ptr()], [address], [64], registry=r)
    assert torch.equal(dst[:64], src[:64])
    storage = weakref.ref(dst.untyped_storage())
    replacement = torch.full((4096,), 0x5A, dtype=torch.uint8)
    if swap == "set_":
        dst.set_(replacement)
    elif swap == "resize_":
        dst.resize_(1 << 22)  # reallocated: the memory at `address` is freed
    else:
        dst.data = replacement
    gc.collect()
    with pytest.raises(ValueError, match=r"dst: its memory changed since it was registered \(data_ptr "
                                         rf"{address:#x}, shape \(4096,\)"):
        kv.host_copy([src.data_ptr()], [address + 64], [64], registry=r)
    with pytest.raises(ValueError, match=r"dst: its memory changed"):
        r.check([address], [64], "host")
    assert (replacement == 0x5A).all()
    if swap != "resize_":  # the registry holds the old storage: its memory stays allocated
        assert storage() is not None
    r.unregister("dst")
    r.check([src.data_ptr()], [4096], "host")  # the rest of the registry checks again


def test_a_kind_other_than_host_device_or_none_is_refused_naming_none():
    r = MemoryRegistry()
    r.register("host", 1 << 20, 4096, kv.MemoryKind.HOST)
    r.check([1 << 20], [4096], None)
    with pytest.raises(ValueError, match=r"kind: expected one of .* got 'any' \(None: either\)"):
        r.check([1 << 20], [4096], "any")
