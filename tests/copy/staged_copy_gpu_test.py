"""kvoffload.staged_copy on a GPU: odd sizes through a small ring that wraps around, host
runs and a job larger than the ring, stream order, and the memory it refuses."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from gpu_pools import DIRECTIONS, check_refused, check_stream_order, pool, run
from scatter import POISON


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


@pytest.mark.parametrize("direction", ["load", "store"])
@pytest.mark.parametrize("size", [1, 17, 4096, 4097, 70_000])
def test_staged_odd_sizes_wrap_around_a_small_ring(direction, size):
    rng = np.random.default_rng(size)
    # 200 copies through 2 slots of 64 KiB: the ring wraps many times.
    result = run(kv.staged_copy, rng, direction, np.full(200, size), 1 << 17, True,
                 pool_bytes=32 << 20, direction=direction, slot_bytes=64 << 10, slots=2)
    assert result.path == "staged" and result.driver_calls >= -(-200 * size // (64 << 10))


def staged_and_checked(rng, direction, host_off, dev_off, sizes, pool_bytes, **ring):
    """Stages copies between offsets of a host and a device pool, the destination
    poisoned; checks every byte of it and returns the result."""
    src_where, dst_where = DIRECTIONS[direction]
    src_bytes = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
    src, dst = pool(src_where, src_bytes), pool(dst_where, np.full(pool_bytes, POISON, np.uint8))
    s_off, d_off = (host_off, dev_off) if direction == "load" else (dev_off, host_off)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    result = kv.staged_copy(s_off + src.data_ptr(), d_off + dst.data_ptr(), sizes, direction=direction,
                            stream=stream, registry=kv.UNCHECKED, **ring)
    stream.synchronize()
    want = np.full(pool_bytes, POISON, np.uint8)
    for s, d, n in zip(s_off, d_off, sizes):
        want[d:d + n] = src_bytes[s:s + n]
    np.testing.assert_array_equal(dst.cpu().numpy(), want)
    return result


@pytest.mark.parametrize("direction", ["load", "store"])
def test_staged_host_runs_and_a_job_larger_than_the_ring(direction):
    rng = np.random.default_rng(3)
    pool_bytes = 64 << 20
    # Host side: 4 KiB blocks packed into runs; device side: scattered at random. 48 MiB
    # moved through a ring of 4 x 4 MiB.
    n, block = 12288, 4096
    host_off = np.arange(n, dtype=np.int64) * block
    dev_off = rng.permutation(pool_bytes // block)[:n].astype(np.int64) * block
    result = staged_and_checked(rng, direction, host_off, dev_off, np.full(n, block), pool_bytes,
                                slot_bytes=4 << 20, slots=4)
    assert result.driver_calls == 12 + 12  # per slot: a kernel, one batch call of a 4 MiB host run


@pytest.mark.parametrize("direction", ["load", "store"])
def test_staged_loads_move_copies_under_64_kib_one_by_one_and_the_rest_batched(direction):
    rng = np.random.default_rng(11)
    pool_bytes = 16 << 20
    small = rng.integers(1, 64 << 10, 10)
    sizes = rng.permutation(np.concatenate([small, np.full(6, 128 << 10), [64 << 10]]))
    # 256 KiB apart on both sides: no two copies make one host run; all fit one slot.
    host_off, dev_off = (rng.permutation(pool_bytes // (256 << 10))[:len(sizes)].astype(np.int64) * (256 << 10)
                         for _ in range(2))
    result = staged_and_checked(rng, direction, host_off, dev_off, sizes, pool_bytes, slot_bytes=4 << 20, slots=2)
    # One slot: its kernel, one batch call, and for loads a call per copy under 64 KiB.
    assert result.driver_calls == 2 + (len(small) if direction == "load" else 0)


def test_staged_copy_follows_stream_order():
    check_stream_order(lambda *a, **k: kv.staged_copy(*a, direction="store", registry=kv.UNCHECKED, **k), 7)


def staged(load):
    return lambda *args, **kwargs: kv.staged_copy(*args, direction="load" if load else "store", **kwargs)


REFUSED = {  # name -> (copy, src memory, dst memory, message)
    "staged load from pageable": (staged(True), "pageable", "device", r"src\[0\]: .* neither page-locked"),
    "staged store to pageable": (staged(False), "device", "pageable", r"dst\[0\]: .* neither page-locked"),
    "staged load into host": (staged(True), "pinned", "pinned", r"dst\[0\]: .* is host memory where device memory"),
    "staged store from host": (staged(False), "pinned", "pinned", r"src\[0\]: .* is host memory where device memory"),
    "staged load from device": (staged(True), "device", "device",
                                r"src\[0\]: .* is device memory where page-locked host memory is needed"),
}


@pytest.mark.parametrize("case", REFUSED.keys())
def test_memory_a_staged_copy_cannot_reach_is_refused_before_copying(case):
    check_refused(*REFUSED[case])
