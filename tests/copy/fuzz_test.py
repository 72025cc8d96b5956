"""Hostile inputs to the checked entry points, on host memory between guard pages and
canaries: each call either raises before copying or copies exactly, and nothing outside
the caller's buffers changes."""


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import kvoffload as kv
from kvoffload.jobs.handler import OffloadHandler
from kvoffload.pages.planner import CPUSpec, GPUSpec, KVLayout
from kvoffload.pages.table import job_arguments, page_table, transfer_plan
from canary import GuardedBuffer
from hostile import copied, ids, jobs, mapping_is_valid, run_jobs, run_jobs_from_two_threads

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
def test_page_table_with_hostile_specs_writes_only_inside_the_layout(block_ids, chunk_ids, sizes, firsts, direction):
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
    table = page_table(layout)
    try:
        plan = transfer_plan(table, table.prepare(*job_arguments(GPUSpec(block_ids, sizes, firsts),
                                                                 CPUSpec(chunk_ids))), kv.Direction.STORE)
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


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 11)), max_size=8), st.integers(0, 4), st.integers(0, 4),
       st.sampled_from([1, 64, 4096]))
def test_copy_blocks_between_views_of_one_buffer(pairs, src_at, dst_at, block):
    # src and dst are blocks [src_at, src_at + 8) and [dst_at, dst_at + 8) of one buffer.
    buf = GuardedBuffer(12 * block)
    whole = blocks(buf, 12, block)
    whole[:] = np.random.default_rng(block + src_at).integers(0, 256, whole.shape, dtype=np.uint8)
    src, dst = whole[src_at:src_at + 8], whole[dst_at:dst_at + 8]
    pairs = [(s % 8, d % 8) for s, d in pairs]
    read, written = {src_at + s for s, _ in pairs}, {dst_at + d for _, d in pairs}
    valid = mapping_is_valid(pairs, 8, 8) and not read & written
    before = whole.copy()
    want = before.copy()
    if valid:
        for s, d in pairs:
            want[dst_at + d] = before[src_at + s]
    try:
        kv.copy_blocks(src, dst, np.array(pairs, dtype=np.int64).reshape(-1, 2))
        assert valid
    except ValueError as e:
        assert not valid and "block_mapping[" in str(e)
    np.testing.assert_array_equal(whole, want)
    assert buf.canaries_intact()


TENSOR_VIEWS = {
    "plain": lambda t: t,
    "expanded": lambda t: t[:, :1].expand(-1, 64),
    "transposed": lambda t: t.t(),
    "strided": lambda t: t[1::3, ::5],
    "one element": lambda t: t[2, 3],
}


@FUZZ
@given(st.sampled_from(sorted(TENSOR_VIEWS)), st.lists(st.tuples(st.integers(-300, 1300), st.integers(-5, 400)),
                                                        min_size=1, max_size=4), st.booleans())
def test_copies_checked_against_a_registered_view_stay_inside_it(view, copies, drop_reference):
    buf = GuardedBuffer(1024)
    buf.array[:] = 0xA5
    tensor = TENSOR_VIEWS[view](torch.from_numpy(buf.array).view(16, 64))
    registry = kv.MemoryRegistry()
    registry.register_tensor("view", tensor)
    start, end = registry.regions[0].start, registry.regions[0].end
    if drop_reference:
        del tensor  # the registry keeps it alive
    src = np.random.default_rng(len(copies)).integers(0, 256, 2048, dtype=np.uint8)
    registry.register("src", src.ctypes.data, src.nbytes, "host")
    dst = [buf.array.ctypes.data + offset for offset, _ in copies]
    sizes = [size for _, size in copies]
    inside = all(size > 0 and start <= d and d + size <= end for d, size in zip(dst, sizes))
    ranges = sorted(zip(dst, sizes))
    inside = inside and all(d + size <= e for (d, size), (e, _) in zip(ranges, ranges[1:]))  # no overlap
    try:
        kv.host_copy([src.ctypes.data] * len(copies), dst, sizes, registry=registry)
        assert inside
    except ValueError:
        assert not inside
        assert (buf.array == 0xA5).all()
    assert buf.canaries_intact()
    lo, hi = start - buf.array.ctypes.data, end - buf.array.ctypes.data
    assert (buf.array[:lo] == 0xA5).all() and (buf.array[hi:] == 0xA5).all()


@FUZZ
@given(st.lists(st.integers(1, 16), max_size=4), st.lists(st.sampled_from([2**62, 2**63 - 2**40, 2**63 - 1]),
                                                         min_size=2, max_size=4), st.randoms())
def test_host_copy_sizes_that_wrap_int64_are_refused_before_copying(small, huge, random):
    # Unchecked, so only the argument checks stand between these sizes and a copy.
    sizes = small + huge
    random.shuffle(sizes)
    buf = GuardedBuffer(64)
    buf.array[:] = 0xA5
    src = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match=r"sizes"):
        kv.host_copy([src.ctypes.data] * len(sizes), [buf.array.ctypes.data] * len(sizes), sizes,
                     registry=kv.UNCHECKED)
    assert (buf.array == 0xA5).all() and buf.canaries_intact()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs, jobs)
def test_handler_with_hostile_jobs_from_two_threads(first, second):
    gpu = [[torch.zeros((6, 64), dtype=torch.uint8) for _ in range(2)]]
    handler = OffloadHandler(gpu, 4, 2)
    run_jobs_from_two_threads(handler, first, second)
