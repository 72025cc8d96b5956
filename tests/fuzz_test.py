"""Hostile inputs to the checked entry points, on host memory between guard pages and
canaries: each call either raises before copying or copies exactly, and nothing outside
the caller's buffers changes."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import kvoffload as kv
from kvoffload.handler import OffloadHandler
from kvoffload.planner import CPUSpec, GPUSpec, KVLayout, plan_transfer
from canary import GuardedBuffer
from hostile import copied, ids, jobs, mapping_is_valid, run_jobs

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def blocks(buffer, n, block):
    return buffer.array[: n * block].reshape(n, block)


@FUZZ
@given(st.lists(st.tuples(ids, ids), max_size=12), st.sampled_from([1, 7, 64, 4096]))
def test_copy_blocks_with_hostile_mappings(pairs, block):
    src_buf, dst_buf = GuardedBuffer(8 * block), GuardedBuffer(6 * block)
    src, dst = blocks(src_buf, 8, block), blocks(dst_buf, 6, block)
    src[:] = np.random.default_rng(block).integers(0, 256, src.shape, dtype=np.uint8)
    dst[:] = 0xA5
    mapping = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    valid = mapping_is_valid(pairs, 8, 6)
    want = copied(src, dst, pairs if valid else [])
    try:
        kv.copy_blocks(src, dst, mapping)
        assert valid
    except ValueError as e:
        assert not valid and "block_mapping[" in str(e)
    np.testing.assert_array_equal(dst, want)
    assert src_buf.canaries_intact() and dst_buf.canaries_intact()


hostile_arrays = st.one_of(
    st.lists(ids, max_size=6),
    st.lists(st.floats(allow_nan=True), min_size=1, max_size=3),
    st.just("text"), st.just(None), st.just(np.zeros((2, 2), np.int64)),
    st.just(np.zeros(3, np.int32)), st.just(np.zeros(4, np.int64)[::2]),
)


@FUZZ
@given(hostile_arrays, hostile_arrays, hostile_arrays)
def test_pointer_apis_reject_malformed_arrays_before_copying(src, dst, sizes):
    # Arrays that are malformed, mismatched, or hold null pointers or sizes <= 0 are refused
    # with a TypeError or ValueError; well-formed raw pointers are not fuzzed here, since
    # the raw API copies wherever it is told (issue 6 adds registered regions).
    def well_formed(a):
        return isinstance(a, list) and all(isinstance(x, int) and -(2**63) <= x < 2**63 for x in a)

    arrays = (src, dst, sizes)
    if all(map(well_formed, arrays)) and len(set(map(len, arrays))) == 1 and all(
            s > 0 and d > 0 and z > 0 for s, d, z in zip(*arrays)):
        return  # an empty batch, or a real copy to arbitrary addresses
    for copy in (kv.host_copy, kv.batch_copy, kv.kernel_copy):
        with pytest.raises((TypeError, ValueError)):
            copy(src, dst, sizes, registry=kv.UNCHECKED)


@FUZZ
@given(st.lists(ids, max_size=8), st.lists(ids, max_size=6), st.lists(st.integers(-2, 6), min_size=2, max_size=3),
       st.lists(st.integers(-2, 9), min_size=2, max_size=3), st.sampled_from(["store", "load"]))
def test_planner_with_hostile_specs_writes_only_inside_the_layout(block_ids, chunk_ids, sizes, firsts, direction):
    bpc, page = 2, 48
    gpu_buf, cpu_buf = GuardedBuffer(2 * 2 * 6 * page), GuardedBuffer(2 * 2 * 4 * bpc * page)
    gpu_bytes = np.random.default_rng(1).integers(0, 256, gpu_buf.array.size, dtype=np.uint8)
    gpu_buf.array[:] = gpu_bytes
    cpu_buf.array[:] = 0xA5
    gpu = [[gpu_buf.array[(2 * g + t) * 6 * page:(2 * g + t + 1) * 6 * page].reshape(6, page) for t in range(2)]
           for g in range(2)]
    cpu = [[cpu_buf.array[(2 * g + t) * 4 * bpc * page:(2 * g + t + 1) * 4 * bpc * page].reshape(4, bpc * page)
            for t in range(2)] for g in range(2)]
    layout = KVLayout.from_tensors([[torch.from_numpy(a) for a in g] for g in gpu],
                                   [[torch.from_numpy(a) for a in g] for g in cpu], bpc)
    try:
        plan = plan_transfer(layout, GPUSpec(block_ids, sizes, firsts), CPUSpec(chunk_ids))
    except (TypeError, ValueError):
        assert cpu_buf.canaries_intact()
        return
    gpu_lo, cpu_lo = gpu_buf.array.ctypes.data, cpu_buf.array.ctypes.data
    for side, lo, n in ((plan.gpu, gpu_lo, gpu_buf.array.size), (plan.cpu, cpu_lo, cpu_buf.array.size)):
        assert ((side >= lo) & (side + plan.sizes <= lo + n)).all()
    if plan.descriptors:
        kv.host_copy(*(plan.store() if direction == "store" else plan.load()), registry=kv.UNCHECKED)
    assert gpu_buf.canaries_intact() and cpu_buf.canaries_intact()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs)
def test_handler_with_hostile_jobs_keeps_working(hostile_jobs):
    gpu = [[torch.zeros((6, 64), dtype=torch.uint8) for _ in range(2)]]
    run_jobs(OffloadHandler(gpu, 4, 2), hostile_jobs)


VIEWS = {  # how a [blocks, 4, 6] array is viewed: (view, whether its blocks stay contiguous)
    "plain": (lambda a: a, True),
    "every other block": (lambda a: a[::2], True),
    "transposed blocks": (lambda a: a.transpose(0, 2, 1), False),
    "half of each block": (lambda a: a[:, :, ::2], False),
    "one block dim": (lambda a: a.reshape(len(a), -1), True),
}


@FUZZ
@given(st.sampled_from(sorted(VIEWS)), st.sampled_from(sorted(VIEWS)), st.sampled_from(["uint8", "float32", "int64"]),
       st.sampled_from(["uint8", "float32", "int64"]), st.lists(st.tuples(st.integers(-1, 5), st.integers(-1, 5)),
                                                                 max_size=6))
def test_copy_blocks_with_hostile_tensors(src_view, dst_view, src_dtype, dst_dtype, pairs):
    src_buf = GuardedBuffer(12 * 4 * 6 * np.dtype(src_dtype).itemsize)
    dst_buf = GuardedBuffer(12 * 4 * 6 * np.dtype(dst_dtype).itemsize)
    src_base = src_buf.array.view(src_dtype).reshape(12, 4, 6)
    dst_base = dst_buf.array.view(dst_dtype).reshape(12, 4, 6)
    src_base[:] = np.random.default_rng(0).integers(0, 100, src_base.shape).astype(src_dtype)
    dst_base[:] = 7
    (view_src, src_ok), (view_dst, dst_ok) = VIEWS[src_view], VIEWS[dst_view]
    src, dst = view_src(src_base), view_dst(dst_base)
    mapping = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    valid = (src_ok and dst_ok and src_dtype == dst_dtype and src.shape[1:] == dst.shape[1:]
             and mapping_is_valid(pairs, len(src), len(dst)))
    want = copied(src, dst, pairs if valid else [])
    try:
        kv.copy_blocks(src, dst, mapping)
        assert valid
    except (TypeError, ValueError):
        assert not valid
    np.testing.assert_array_equal(dst, want)
    assert src_buf.canaries_intact() and dst_buf.canaries_intact()
