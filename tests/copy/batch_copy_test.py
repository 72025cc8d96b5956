"""kvoffload.copy.batch_copy on a machine without a GPU: the host path, argument checks,
path choice, and the no-device error."""

import functools
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload.copy.batch_copy import MAX_HOST_THREADS, _HOST_THREADING_BYTES, _device_path
from scatter import POISON, poisoned, random_bytes, scatter

HOST_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def host_pools(rng, pool_bytes):
    return random_bytes(rng, pool_bytes), poisoned(pool_bytes)


class TestHostCopy:
    @pytest.mark.parametrize("size", [1, 3, 15, 16, 17, 4095, 4096, 4097])
    def test_scattered_copies_of_one_size(self, rng, size):
        src, dst = host_pools(rng, 1 << 20)
        plan = scatter(rng, np.full(50, size), slot=8192, pool_bytes=src.size, misalign=True)
        want = plan.expected(src, dst)
        result = kv.host_copy(*plan.pointers(src.ctypes.data, dst.ctypes.data), plan.sizes,
                              registry=kv.UNCHECKED)
        np.testing.assert_array_equal(dst, want)
        assert (result.path, result.copies, result.bytes) == ("host", 50, 50 * size)

    def test_mixed_sizes_from_python_lists(self, rng):
        src, dst = host_pools(rng, 1 << 20)
        plan = scatter(rng, rng.integers(1, 4097, 200), slot=4096, pool_bytes=src.size)
        want = plan.expected(src, dst)
        s, d = plan.pointers(src.ctypes.data, dst.ctypes.data)
        kv.host_copy(s.tolist(), d.tolist(), plan.sizes.tolist(), registry=kv.UNCHECKED)
        np.testing.assert_array_equal(dst, want)

    def test_torch_int64_pointer_arrays(self, rng):
        src, dst = host_pools(rng, 1 << 16)
        plan = scatter(rng, np.full(10, 64), slot=64, pool_bytes=src.size)
        want = plan.expected(src, dst)
        s, d = plan.pointers(src.ctypes.data, dst.ctypes.data)
        kv.host_copy(torch.from_numpy(s), torch.from_numpy(d), torch.from_numpy(plan.sizes),
                     registry=kv.UNCHECKED)
        np.testing.assert_array_equal(dst, want)

    @pytest.mark.parametrize("sizes", [[48 << 20], [1 << 20] * 40, [7] * 3 + [40 << 20] + [5] * 3])
    def test_large_batches_split_over_threads(self, rng, sizes):
        total = sum(sizes)
        src, dst = random_bytes(rng, total), poisoned(total + 64)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        result = kv.host_copy(offsets + src.ctypes.data, offsets + dst.ctypes.data + 32,
                              sizes, threads=3, registry=kv.UNCHECKED)
        assert total >= _HOST_THREADING_BYTES and result.driver_calls == 3
        np.testing.assert_array_equal(dst[32 : 32 + total], src)
        assert (dst[:32] == POISON).all() and (dst[32 + total :] == POISON).all()

    def test_empty_batch_copies_nothing(self):
        result = kv.host_copy([], [], [], registry=kv.UNCHECKED)
        assert (result.path, result.copies, result.bytes) == ("none", 0, 0)


def _valid_arrays(src, dst, n=3, size=8):
    s = np.arange(n, dtype=np.int64) * size + src.ctypes.data
    d = np.arange(n, dtype=np.int64) * size + dst.ctypes.data
    return s, d, np.full(n, size, dtype=np.int64)


# (what to change, exception, the message's start). Each names the argument at fault.
BAD_ARRAYS = {
    "dst shorter": (lambda s, d, z: (s, d[:2], z), ValueError, r"dst: has 2 entries but src has 3"),
    "sizes shorter": (lambda s, d, z: (s, d, z[:1]), ValueError, r"sizes: has 1 entries"),
    "zero size": (lambda s, d, z: (s, d, np.array([8, 0, 8])), ValueError, r"sizes\[1\]: must be > 0"),
    "negative size": (lambda s, d, z: (s, d, np.array([8, 8, -4])), ValueError, r"sizes\[2\]: must be > 0"),
    "null src": (lambda s, d, z: (np.array([s[0], 0, s[2]]), d, z), ValueError, r"src\[1\]: null pointer"),
    "null dst": (lambda s, d, z: (s, np.array([d[0], d[1], 0]), z), ValueError, r"dst\[2\]: null pointer"),
    "negative src": (lambda s, d, z: (np.array([s[0], -8, s[2]]), d, z), ValueError, r"src\[1\]: negative address"),
    "int32 src": (lambda s, d, z: (s.astype(np.int32), d, z), TypeError, r"src: expected dtype int64"),
    "float sizes": (lambda s, d, z: (s, d, z.astype(np.float64)), TypeError, r"sizes: expected dtype int64"),
    "2-D dst": (lambda s, d, z: (s, d.reshape(3, 1), z), ValueError, r"dst: expected a 1-D array, got 2-D"),
    "strided src": (lambda s, d, z: (np.repeat(s, 2)[::2], d, z), ValueError, r"src: must be C-contiguous"),
    "float in list": (lambda s, d, z: (s, d, [8.0, 8, 8]), TypeError, r"sizes\[0\]: expected an int"),
    "bool in list": (lambda s, d, z: (s, [True] + d.tolist()[1:], z), TypeError, r"dst\[0\]: expected an int"),
    "string": (lambda s, d, z: ("abc", d, z), TypeError, r"src: expected a 1-D int64 array"),
    "dict": (lambda s, d, z: (s, {}, z), TypeError, r"dst: expected a 1-D int64 array"),
    "huge int": (lambda s, d, z: (s, d, [1 << 64, 8, 8]), ValueError, r"sizes\[0\]: does not fit in int64"),
}


def staged_load(src, dst, sizes, **kwargs):
    return kv.staged_copy(src, dst, sizes, "load", **kwargs, registry=kv.UNCHECKED)


kernel_copy = functools.partial(kv.kernel_copy, registry=kv.UNCHECKED)
ALL_COPIES = {"host_copy": functools.partial(kv.host_copy, registry=kv.UNCHECKED),
              "batch_copy": functools.partial(kv.batch_copy, registry=kv.UNCHECKED),
              "kernel_copy": kernel_copy, "staged_copy": staged_load}


@pytest.mark.parametrize("copy", ALL_COPIES.values(), ids=ALL_COPIES.keys())
@pytest.mark.parametrize("case", BAD_ARRAYS.keys())
def test_bad_arrays_raise_naming_the_argument_and_copy_nothing(rng, copy, case):
    change, error, message = BAD_ARRAYS[case]
    src, dst = random_bytes(rng, 64), poisoned(64)
    with pytest.raises(error, match=message):
        copy(*change(*_valid_arrays(src, dst)))
    assert (dst == POISON).all()


BAD_BATCH_OPTIONS = {
    "order value": (dict(order=7), ValueError, r"order: 7 is not a source access order"),
    "order per copy": (dict(order=[1, 3, 4]), ValueError, r"order\[2\]: 4 is not a source access order"),
    "order length": (dict(order=[1, 3]), ValueError, r"order: has 2 entries but there are 3 copies"),
    "order type": (dict(order="ANY"), TypeError, r"order: expected a 1-D int64 array"),
    "stream type": (dict(stream="s"), TypeError, r"stream: expected None, an int handle"),
    "stream float": (dict(stream=2.0), TypeError, r"stream: expected None"),
    "stream bool": (dict(stream=True), TypeError, r"stream: expected None"),
    "stream negative": (dict(stream=-1), ValueError, r"stream: handle must be >= 0"),
    "chunk size": (dict(_max_copies_per_call=-1), ValueError, r"max_copies_per_call: must be >= 0"),
}


@pytest.mark.parametrize("case", BAD_BATCH_OPTIONS.keys())
def test_bad_batch_options_raise_naming_the_argument(rng, case):
    kwargs, error, message = BAD_BATCH_OPTIONS[case]
    src, dst = random_bytes(rng, 64), poisoned(64)
    with pytest.raises(error, match=message):
        kv.batch_copy(*_valid_arrays(src, dst), **kwargs, registry=kv.UNCHECKED)
    assert (dst == POISON).all()


BAD_KERNEL_OPTIONS = [
    (kernel_copy, dict(max_ctas=0), r"max_ctas: must be >= 1, got 0"),
    (kernel_copy, dict(_piece_bytes=8), r"piece_bytes: must be >= 16, got 8"),
    (staged_load, dict(max_ctas=-1), r"max_ctas: must be >= 1, got -1"),
    (staged_load, dict(slot_bytes=1000), r"slot_bytes: must be a multiple of 256 and >= 4096"),
    (staged_load, dict(slots=1), r"slots: must be >= 2, got 1"),
]


@pytest.mark.parametrize("copy,kwargs,message", BAD_KERNEL_OPTIONS)
def test_bad_kernel_and_staging_options_raise_naming_the_option(rng, copy, kwargs, message):
    src, dst = random_bytes(rng, 64), poisoned(64)
    with pytest.raises(ValueError, match=message):
        copy(*_valid_arrays(src, dst), **kwargs)
    assert (dst == POISON).all()


def test_a_bad_copy_last_in_the_batch_stops_every_copy(rng):
    src, dst = random_bytes(rng, 1 << 16), poisoned(1 << 16)
    plan = scatter(rng, np.full(1000, 32), slot=64, pool_bytes=src.size)
    s, d = plan.pointers(src.ctypes.data, dst.ctypes.data)
    d[-1] = 0
    with pytest.raises(ValueError, match=r"dst\[999\]: null pointer"):
        kv.host_copy(s, d, plan.sizes, registry=kv.UNCHECKED)
    assert (dst == POISON).all()


class FakeTorchStream:
    def __init__(self, handle):
        self.cuda_stream = handle


class FakeCudaPythonStream:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


CREATED_STREAM = 0x5A5A0000

# (stream, batch entry point resolved, per-copy requested) -> (path, reason)
DEVICE_PATHS = [
    (None, True, False, "per_copy", "legacy default stream"),
    (0, True, False, "per_copy", "legacy default stream"),
    (1, True, False, "per_copy", "legacy default stream"),
    (2, True, False, "batch", "driver batch copy available"),
    (CREATED_STREAM, True, False, "batch", "driver batch copy available"),
    (CREATED_STREAM, False, False, "per_copy", "driver has no cuMemcpyBatchAsync"),
    (2, False, False, "per_copy", "driver has no cuMemcpyBatchAsync"),
    (None, False, False, "per_copy", "legacy default stream"),
    (CREATED_STREAM, True, True, "per_copy", "per-copy requested"),
    (None, True, True, "per_copy", "per-copy requested"),
    (FakeTorchStream(CREATED_STREAM), True, False, "batch", "driver batch copy available"),
    (FakeTorchStream(0), True, False, "per_copy", "legacy default stream"),
    (FakeCudaPythonStream(1), True, False, "per_copy", "legacy default stream"),
    (FakeCudaPythonStream(CREATED_STREAM), True, False, "batch", "driver batch copy available"),
]


@pytest.mark.parametrize("stream,entry_point,per_copy,path,reason", DEVICE_PATHS)
def test_device_path_names_its_reason(stream, entry_point, per_copy, path, reason):
    got_path, got_reason = _device_path(stream, entry_point, per_copy)
    assert got_path == path and got_reason.startswith(reason)


def test_a_stream_protocol_that_returns_no_pair_is_a_type_error():
    class Broken:
        def __cuda_stream__(self):
            return 5

    with pytest.raises(TypeError, match=r"stream: __cuda_stream__\(\) must return"):
        _device_path(Broken(), True)


@HOST_ONLY
@pytest.mark.parametrize("stream", [None, 2, CREATED_STREAM])
def test_batch_copy_without_a_gpu_raises_no_cuda_device(rng, stream):
    src, dst = random_bytes(rng, 64), poisoned(64)
    with pytest.raises(kv.NoCudaDeviceError, match=r"no CUDA device") as info:
        kv.batch_copy(*_valid_arrays(src, dst), stream=stream, registry=kv.UNCHECKED)
    assert isinstance(info.value, kv.CudaError)
    assert "cudaErrorInsufficientDriver" in str(info.value) or "cudaErrorNoDevice" in str(info.value)
    assert (dst == POISON).all()


@HOST_ONLY
@pytest.mark.parametrize("copy", [kernel_copy, staged_load], ids=["kernel_copy", "staged_copy"])
def test_kernel_and_staged_copies_without_a_gpu_raise_no_cuda_device(rng, copy):
    src, dst = random_bytes(rng, 64), poisoned(64)
    with pytest.raises(kv.NoCudaDeviceError, match=r"no CUDA device"):
        copy(*_valid_arrays(src, dst))
    assert (dst == POISON).all()


@HOST_ONLY
def test_batch_entry_point_without_a_gpu_raises_no_cuda_device():
    with pytest.raises(kv.NoCudaDeviceError):
        kv.batch_entry_point_version()


@HOST_ONLY
def test_load_kernels_without_a_gpu_raises_no_cuda_device():
    with pytest.raises(kv.NoCudaDeviceError):
        kv.load_kernels(0)


def test_load_kernels_rejects_a_negative_device():
    with pytest.raises(ValueError, match=r"device: must be >= 0, got -1"):
        kv.load_kernels(-1)


def _block_tensors(rng, make, src_blocks=16, dst_blocks=12, block_shape=(2, 3, 5)):
    src = make(rng.standard_normal((src_blocks, *block_shape)).astype(np.float32))
    dst = make(np.full((dst_blocks, *block_shape), -7.0, dtype=np.float32))
    return src, dst


TENSOR_KINDS = {"numpy": np.ascontiguousarray, "torch": torch.from_numpy}


class TestCopyBlocks:
    @pytest.mark.parametrize("kind", TENSOR_KINDS.keys())
    def test_random_mapping_on_host(self, rng, kind):
        src, dst = _block_tensors(rng, TENSOR_KINDS[kind])
        mapping = np.stack([rng.permutation(16)[:9], rng.permutation(12)[:9]], axis=1)
        want = np.asarray(dst).copy()
        want[mapping[:, 1]] = np.asarray(src)[mapping[:, 0]]
        result = kv.copy_blocks(src, dst, mapping)
        np.testing.assert_array_equal(np.asarray(dst), want)
        assert (result.path, result.copies, result.bytes) == ("host", 9, 9 * 30 * 4)

    def test_strided_blocks_of_a_view(self, rng):
        # Blocks of a [layers, blocks, ...] cache seen through one layer: dim-0 stride > block.
        cache = torch.from_numpy(rng.standard_normal((2, 8, 4, 4)).astype(np.float32))
        host = torch.full((2, 8, 4, 4), -1.0)
        mapping = torch.tensor([[0, 7], [5, 2], [3, 3]])
        kv.copy_blocks(cache[:, :, :, :].permute(1, 0, 2, 3)[:, 1], host[1], mapping)
        want = torch.full((2, 8, 4, 4), -1.0)
        want[1][mapping[:, 1]] = cache[1][mapping[:, 0]]
        assert torch.equal(host, want)

    def test_empty_mapping_copies_nothing(self, rng):
        src, dst = _block_tensors(rng, np.ascontiguousarray)
        result = kv.copy_blocks(src, dst, np.zeros((0, 2), dtype=np.int64))
        assert result.path == "none" and (dst == -7.0).all()

    BAD = {
        "src block too large": (lambda m: m.__setitem__((2, 0), 16), ValueError,
                                r"block_mapping\[2, 0\]: source block 16 is out of range for src with 16 blocks"),
        "negative src block": (lambda m: m.__setitem__((0, 0), -1), ValueError,
                               r"block_mapping\[0, 0\]: source block -1 is out of range"),
        "dst block too large": (lambda m: m.__setitem__((3, 1), 12), ValueError,
                                r"block_mapping\[3, 1\]: destination block 12 is out of range for dst with 12 blocks"),
        "dst written twice": (lambda m: m.__setitem__((4, 1), m[1, 1]), ValueError,
                              r"block_mapping\[4, 1\]: destination block \d+ is written twice"),
    }

    @pytest.mark.parametrize("case", BAD.keys())
    def test_bad_block_ids_raise_and_copy_nothing(self, rng, case):
        src, dst = _block_tensors(rng, np.ascontiguousarray)
        mapping = np.stack([rng.permutation(16)[:6], rng.permutation(12)[:6]], axis=1)
        change, error, message = self.BAD[case]
        change(mapping)
        with pytest.raises(error, match=message):
            kv.copy_blocks(src, dst, mapping)
        assert (dst == -7.0).all()

    def test_bad_tensors_and_mappings(self, rng):
        src, dst = _block_tensors(rng, np.ascontiguousarray)
        ok = np.array([[0, 0]], dtype=np.int64)
        cases = [
            ((src, dst.astype(np.float64), ok), TypeError, r"dst: dtype differs"),
            ((src, dst[:, :1], ok), ValueError, r"dst: shape differs from src's in dim 1"),
            ((src, np.zeros((12, 2, 3), np.float32), ok), ValueError, r"dst: rank differs"),
            ((src[:, :, :, ::2], dst[..., :3], ok), ValueError, r"src: each block .* must be contiguous"),
            ((src, np.broadcast_to(dst[:1], dst.shape), ok), TypeError, r"dst: expected a writable DLPack tensor"),
            ((src, dst, ok.astype(np.int32)), TypeError, r"block_mapping: expected dtype int64"),
            ((src, dst, np.zeros((2, 3), np.int64)), ValueError, r"block_mapping: expected shape \[N, 2\], got \[2, 3\]"),
            ((src, dst, np.zeros(4, np.int64)), ValueError, r"block_mapping: expected a 2-D array, got 1-D"),
            ((src, dst, [[0, 0]]), TypeError, r"block_mapping: expected a 2-D int64 array"),
            (("src", dst, ok), TypeError, r"src: expected a DLPack tensor"),
            ((src.astype(">f4"), dst, ok), TypeError, r"src: dtype >f4 is not in this machine's byte order"),
            ((src, dst.astype(">f4"), ok), TypeError, r"dst: dtype >f4 is not in this machine's byte order"),
            ((np.zeros(src.shape, "V4"), dst, ok), TypeError, r"src: dtype \|V4 has no DLPack type"),
        ]
        for args, error, message in cases:
            with pytest.raises(error, match=message):
                kv.copy_blocks(*args)
        assert (dst == -7.0).all()

    def test_overlapping_destination_blocks_are_rejected(self, rng):
        src, _ = _block_tensors(rng, torch.from_numpy)
        flat = torch.zeros(200)
        overlapping = flat.as_strided((4, 2, 3, 5), (10, 15, 5, 1))
        with pytest.raises(ValueError, match=r"dst: blocks overlap"):
            kv.copy_blocks(src, overlapping, torch.tensor([[0, 0]]))


def test_host_copy_threads_are_capped_and_validated(rng):
    n = _HOST_THREADING_BYTES
    src, dst = random_bytes(rng, n), poisoned(n)
    result = kv.host_copy([src.ctypes.data], [dst.ctypes.data], [n], threads=40000, registry=kv.UNCHECKED)
    assert result.driver_calls == MAX_HOST_THREADS
    np.testing.assert_array_equal(dst, src)
    with pytest.raises(ValueError, match=r"threads: must be >= 0, got -1"):
        kv.host_copy([src.ctypes.data], [dst.ctypes.data], [n], threads=-1, registry=kv.UNCHECKED)
    assert kv.host_copy([src.ctypes.data], [dst.ctypes.data], [n], threads=2**40,
                        registry=kv.UNCHECKED).driver_calls == MAX_HOST_THREADS
    for bad, error, message in ((True, TypeError, r"threads: expected an int, got bool"),
                                (2.0, TypeError, r"threads: expected an int, got float")):
        with pytest.raises(error, match=message):
            kv.host_copy([src.ctypes.data], [dst.ctypes.data], [n], threads=bad, registry=kv.UNCHECKED)


@pytest.mark.parametrize("case, message", [
    ("two destinations", r"dst\[0\] and dst\[1\]: overlap"),
    ("a destination over a source", r"src\[1\] and dst\[1\]: overlap"),
    ("a copy onto itself, shifted", r"src\[0\] and dst\[0\]: overlap"),
])
def test_host_copy_refuses_overlapping_ranges_before_copying(rng, case, message):
    n = _HOST_THREADING_BYTES  # threaded: such copies would tear
    buf = poisoned(4 * n)
    a = buf.ctypes.data
    srcs, dsts = {"two destinations": ([a, a + n], [a + 2 * n, a + 3 * n - 64]),
                  "a destination over a source": ([a, a + 2 * n], [a + n, a + 2 * n + n // 2]),
                  "a copy onto itself, shifted": ([a], [a + 64])}[case]
    with pytest.raises(ValueError, match=message):
        kv.host_copy(srcs, dsts, [n] * len(srcs), registry=kv.UNCHECKED)
    assert (buf == poisoned(1)[0]).all()  # nothing copied


def test_host_copy_takes_sources_that_overlap_each_other(rng):
    n = _HOST_THREADING_BYTES
    src, dst = random_bytes(rng, n + 4096), poisoned(2 * n)
    kv.host_copy([src.ctypes.data, src.ctypes.data + 4096], [dst.ctypes.data, dst.ctypes.data + n], [n, n],
                 registry=kv.UNCHECKED)
    np.testing.assert_array_equal(dst[:n], src[:n])
    np.testing.assert_array_equal(dst[n:], src[4096:])


_NO_ROOM_FOR_THREADS = """
import resource, sys
import numpy as np
import kvoffload as kv
from kvoffload.copy.batch_copy import _HOST_THREADING_BYTES
n = _HOST_THREADING_BYTES
rng = np.random.default_rng(int(sys.argv[1]))
src, dst = rng.integers(0, 256, n, dtype=np.uint8), np.full(n, 0xA5, np.uint8)
vm_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, ((vm_kib << 10) + (4 << 20), hard))  # room for no thread stacks
try:
    kv.host_copy([src.ctypes.data], [dst.ctypes.data], [n], threads=64, registry=kv.UNCHECKED)
    outcome = "copied"
except RuntimeError as e:
    outcome = "refused" if "could not start thread" in str(e) else repr(e)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
print(outcome, bool((dst == src).all()) if outcome == "copied" else bool((dst == 0xA5).all()))
"""


def test_a_thread_that_cannot_start_raises_and_copies_nothing(rng):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", _NO_ROOM_FOR_THREADS, str(rng.integers(1 << 30))],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["refused", "True"]


def test_sizes_adding_up_past_int64_are_refused(rng):
    src, dst = random_bytes(rng, 64), poisoned(64)
    huge = [int(x) for x in rng.integers(2**61, 2**62, 4)]  # each fits after its pointer
    with pytest.raises(ValueError, match=r"sizes: add up to more than 2\^63 - 1 bytes"):
        kv.host_copy([src.ctypes.data] * 4, [dst.ctypes.data] * 4, huge, registry=kv.UNCHECKED)
    assert (dst == POISON).all()


class TestCopyBlocksSoundness:
    def test_a_block_both_read_and_written_is_refused(self, rng):
        for _ in range(20):
            blocks = int(rng.integers(4, 64))
            cache = torch.from_numpy(rng.integers(0, 256, (blocks, 4096), dtype=np.uint8))
            ids = rng.permutation(blocks)
            half = len(ids) // 2
            mapping = np.stack([ids[:half], ids[half:2 * half]], axis=1)
            want = cache.clone()
            want[mapping[:, 1]] = cache[mapping[:, 0]]
            shared = mapping.copy()
            i, j = rng.integers(0, half, 2)
            shared[i, 1] = shared[j, 0]
            before = cache.clone()
            with pytest.raises(ValueError, match=rf"block_mapping\[{i}, 1\]: destination block shares memory "
                                                 rf"with the source block of block_mapping\[{j}, 0\]"):
                kv.copy_blocks(cache, cache, shared)
            assert torch.equal(cache, before)
            kv.copy_blocks(cache, cache, mapping)  # disjoint blocks of one tensor: fine
            assert torch.equal(cache, want)

    def test_views_of_one_tensor_that_overlap_are_refused(self, rng):
        cache = torch.from_numpy(rng.integers(0, 256, (8, 512), dtype=np.uint8))
        before = cache.clone()
        with pytest.raises(ValueError, match=r"shares memory"):
            kv.copy_blocks(cache[:5], cache[3:], np.array([[1, 0], [3, 2]]))  # block 3 is read and written
        assert torch.equal(cache, before)
        kv.copy_blocks(cache[:5], cache[3:], np.array([[1, 1], [0, 3]]))  # reads 0, 1; writes 4, 6
        assert torch.equal(cache[4], before[1]) and torch.equal(cache[6], before[0])

    @pytest.mark.parametrize("side", ["src", "dst"])
    @pytest.mark.parametrize("bit", ["conj", "neg"])
    def test_tensors_with_a_conjugate_or_negative_bit_are_refused(self, rng, side, bit):
        values = torch.from_numpy(rng.standard_normal((6, 4, 2)).astype(np.float32))
        tensor = torch.view_as_complex(values.clone())
        plain = torch.full_like(tensor, 7.0)
        lazy = tensor.conj() if bit == "conj" else torch._neg_view(tensor)
        src, dst = (lazy, plain) if side == "src" else (plain, lazy)
        before = dst.resolve_conj().resolve_neg().clone()
        with pytest.raises(ValueError, match=rf"{side}: has its {bit} bit set; call resolve_{bit}\(\) first"):
            kv.copy_blocks(src, dst, np.array([[0, 1], [2, 3]]))
        assert torch.equal(dst.resolve_conj().resolve_neg(), before)

    def test_empty_tensors_and_blocks(self):
        for shape in [(0, 8), (4, 0), (4, 0, 3), (0,)]:
            src, dst = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
            assert kv.copy_blocks(src, dst, np.zeros((0, 2), np.int64)).copies == 0

    @pytest.mark.parametrize("kwargs,error,message", [
        (dict(order=99), ValueError, r"order: 99 is not a source access order"),
        (dict(stream="bogus"), TypeError, r"stream: expected None, an int handle"),
        (dict(order=[1]), ValueError, r"order: has 1 entries but there are 2 copies"),
    ])
    def test_the_host_path_checks_order_and_stream(self, rng, kwargs, error, message):
        src, dst = _block_tensors(rng, np.ascontiguousarray)
        with pytest.raises(error, match=message):
            kv.copy_blocks(src, dst, np.array([[0, 1], [2, 3]]), **kwargs)
        assert (dst == -7.0).all()

    def test_numpy_integers_for_order_and_stream(self, rng):
        src, dst = _block_tensors(rng, np.ascontiguousarray)
        kv.copy_blocks(src, dst, np.array([[5, 1]]), stream=np.int64(0), order=np.int64(3))
        np.testing.assert_array_equal(dst[1], src[5])
        assert _device_path(np.int64(CREATED_STREAM), True) == _device_path(CREATED_STREAM, True)


# One bad argument, every entry point and mode: the same exception and message. Each case
# turns valid (src, dst, sizes) into bad ones; torch without CUDA cannot make the GPU case.
ONE_BAD_ARGUMENT = {
    "2-D dst": (lambda s, d, z: (s, d.reshape(-1, 1), z), ValueError, "dst: expected a 1-D array, got 2-D"),
    "int32 src": (lambda s, d, z: (s.astype(np.int32), d, z), TypeError, "src: expected dtype int64"),
    "uint64 dst": (lambda s, d, z: (s, d.astype(np.uint64), z), TypeError, "dst: expected dtype int64"),
    "torch int32 sizes": (lambda s, d, z: (s, d, torch.from_numpy(z).int()), TypeError, "sizes: expected dtype int64"),
    "float sizes": (lambda s, d, z: (s, d, z.astype(np.float64)), TypeError, "sizes: expected dtype int64"),
    "bool sizes": (lambda s, d, z: (s, d, z > 0), TypeError, "sizes: expected dtype int64"),
    "strided src": (lambda s, d, z: (np.repeat(s, 2)[::2], d, z), ValueError, "src: must be C-contiguous"),
    "0-D sizes": (lambda s, d, z: (s, d, np.int64(8)), ValueError, "sizes: expected a 1-D array, got 0-D"),
    "None src": (lambda s, d, z: (None, d, z), TypeError,
                 "src: expected a 1-D int64 array or a sequence of ints, got NoneType"),
    "None sizes": (lambda s, d, z: (s, d, None), TypeError,
                   "sizes: expected a 1-D int64 array or a sequence of ints, got NoneType"),
    "short dst": (lambda s, d, z: (s, d[:-1], z), ValueError, "dst: has 4 entries but src has 5"),
    "long sizes": (lambda s, d, z: (s, d, np.append(z, 8)), ValueError, "sizes: has 6 entries but src has 5"),
    "float in list": (lambda s, d, z: (s, d, [8.0] + z.tolist()[1:]), TypeError, r"sizes[0]: expected an int, got float"),
    "zero size": (lambda s, d, z: (s, d, np.where(np.arange(5) == 3, 0, z)), ValueError, "sizes[3]: must be > 0, got 0"),
    "CUDA src": (lambda s, d, z: (torch.from_numpy(s).cuda(), d, z), ValueError,
                 "src: must be in host memory, got device type 2"),
}
NEEDS_CUDA = {"CUDA src"}
# Errors of one array, the same from the registry's own check (lengths and values are
# the copy calls' to check).
ONE_ARRAY_CASES = {"2-D dst", "int32 src", "uint64 dst", "torch int32 sizes", "float sizes", "bool sizes",
                   "strided src", "0-D sizes", "None src", "None sizes", "CUDA src"}


def every_mode(registry):
    """name -> copy(src, dst, sizes) for every raw-pointer entry point with ``registry``."""
    from kvoffload.copy.methods import CANDIDATES
    from kvoffload.costs import auto

    modes = {
        "host_copy": functools.partial(kv.host_copy, registry=registry),
        "batch_copy": functools.partial(kv.batch_copy, registry=registry),
        "batch_copy per_copy": functools.partial(kv.batch_copy, per_copy=True, registry=registry),
        "kernel_copy": functools.partial(kv.kernel_copy, registry=registry),
        "staged_copy h2d": functools.partial(kv.staged_copy, direction="load", registry=registry),
        "staged_copy d2h": functools.partial(kv.staged_copy, direction="store", registry=registry),
    }
    for method in ("auto",) + tuple(CANDIDATES):
        for direction in kv.Direction:
            modes[f"auto.copy {method} {direction}"] = functools.partial(
                auto.copy, direction=direction, method=method, registry=registry)
    return modes


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.skipif(
    c in NEEDS_CUDA and not torch.cuda.is_available(), reason="needs a CUDA tensor")) for c in ONE_BAD_ARGUMENT])
def test_one_bad_argument_gets_one_error_in_every_mode(rng, case):
    change, error, message = ONE_BAD_ARGUMENT[case]
    src, dst = random_bytes(rng, 4096), poisoned(4096)
    offsets = rng.permutation(4096 // 64)[:5].astype(np.int64) * 64
    args = change(offsets + src.ctypes.data, offsets + dst.ctypes.data, rng.integers(1, 65, 5))
    registry = kv.MemoryRegistry()
    registry.register("src", src.ctypes.data, src.nbytes, kv.MemoryKind.HOST)
    registry.register("dst", dst.ctypes.data, dst.nbytes, kv.MemoryKind.HOST)
    raised = {}
    for name, copy in {**{f"{m}, unchecked": c for m, c in every_mode(kv.UNCHECKED).items()},
                       **{f"{m}, registry": c for m, c in every_mode(registry).items()}}.items():
        with pytest.raises(Exception) as e:
            copy(*args)
        raised[name] = (type(e.value), str(e.value))
    if case in ONE_ARRAY_CASES:
        with pytest.raises(Exception) as e:
            registry.check_copies(*args)
        raised["MemoryRegistry.check_copies"] = (type(e.value), str(e.value))
    assert {mode: got for mode, got in raised.items() if got != (error, message)} == {}
    assert (dst == POISON).all()


def _read_only_file(tmp_path, nbytes=1 << 16):
    path = tmp_path / "kv.bin"
    path.write_bytes(bytes([0x5A]) * nbytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: the array is not writable
        return path, torch.from_numpy(np.memmap(path, mode="r", dtype=np.uint8))


def test_copy_blocks_refuses_a_destination_over_read_only_memory(tmp_path, rng):
    path, read_only = _read_only_file(tmp_path)
    src = torch.from_numpy(rng.integers(0, 256, (8, 64), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"^dst: bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) are not writable memory"):
        kv.copy_blocks(src, read_only[:512].view(8, 64), torch.tensor([[0, 1]]))
    # numpy marks a memmap read-only (refused as DLPack); torch's view of it is not marked.
    with pytest.raises(ValueError, match=r"^dst: bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) are not writable memory"):
        kv.copy_blocks(src.numpy(), read_only.numpy()[:512].reshape(8, 64), np.array([[0, 1]]))
    with pytest.raises(TypeError, match=r"^dst: expected a writable DLPack tensor"):
        kv.copy_blocks(src.numpy(), np.memmap(path, mode="r", dtype=np.uint8)[:512].reshape(8, 64),
                       np.array([[0, 1]]))
    # As a source it serves.
    dst = torch.zeros(8, 64, dtype=torch.uint8)
    kv.copy_blocks(read_only[:512].view(8, 64), dst, torch.tensor([[0, 3]]))
    assert (dst[3] == 0x5A).all() and (dst[[0, 1, 2, 4, 5, 6, 7]] == 0).all()
    assert path.read_bytes() == bytes([0x5A]) * (1 << 16)


def test_host_copy_refuses_a_registered_destination_over_read_only_memory(tmp_path, rng):
    path, read_only = _read_only_file(tmp_path)
    src = random_bytes(rng, 4096)
    registry = kv.MemoryRegistry()
    registry.register_tensor("file", read_only)
    registry.register("src", src.ctypes.data, src.nbytes, "host")
    with pytest.raises(ValueError, match=r"^dst\[1\]: \[0x[0-9a-f]+, 0x[0-9a-f]+\) lies in file, read-only memory"):
        kv.host_copy([src.ctypes.data] * 2, [src.ctypes.data + 2048, read_only.data_ptr() + 64], [64, 64],
                     registry=registry)
    out = poisoned(64)
    registry.register("out", out.ctypes.data, out.nbytes, "host")
    kv.host_copy([read_only.data_ptr()], [out.ctypes.data], [64], registry=registry)  # read: fine
    assert (out == 0x5A).all() and path.read_bytes() == bytes([0x5A]) * (1 << 16)
