"""Hostile inputs to every entry point on a GPU, over device and pinned host buffers
between canary bytes: each call raises before copying or copies exactly, and no byte
outside the registered buffers changes."""


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import kvoffload as kv
from canary import TorchGuardedBuffer
from hostile import copied, ids, jobs, mapping_is_valid, run_jobs, run_jobs_from_two_threads
from kvoffload.jobs.handler import OffloadHandler
from scale import scaled

EXAMPLES = scaled(300, 10)
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
N = 64 << 10
offsets = st.one_of(st.integers(-5000, N + 5000), st.integers(0, N - 1), st.sampled_from([-(2**62), 2**62]))
sizes = st.one_of(st.integers(1, 6000), st.sampled_from([0, -1, 2**63 - 1, 2**62, N, N + 1]))


@pytest.fixture(scope="module")
def buffers():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"
    return {where: (TorchGuardedBuffer(torch, N, where), TorchGuardedBuffer(torch, N, where))
            for where in ("host", "device")}


def refill(src, dst, seed):
    data = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, N, dtype=np.uint8))
    src.tensor.copy_(data)
    dst.tensor.fill_(0xA5)
    torch.cuda.synchronize()
    return data.numpy()


PATHS = {  # name -> (copy, src side, dst side)
    "per_copy h2d": (lambda *a, **k: kv.batch_copy(*a, per_copy=True, **k), "host", "device"),
    "batch d2h": (kv.batch_copy, "device", "host"),
    "batch d2d": (kv.batch_copy, "device", "device"),
    "kernel h2d": (kv.kernel_copy, "host", "device"),
    "kernel d2h": (kv.kernel_copy, "device", "host"),
    "staged h2d": (lambda s, d, z, st, **k: kv.staged_copy(s, d, z, "load", st, **k), "host", "device"),
    "staged d2h": (lambda s, d, z, st, **k: kv.staged_copy(s, d, z, "store", st, **k), "device", "host"),
}


@FUZZ
@given(st.sampled_from(sorted(PATHS)), st.lists(st.tuples(offsets, offsets, sizes), max_size=8), st.integers(0, 2**32))
def test_pointer_calls_with_a_registry_copy_exactly_or_refuse(buffers, path, copies, seed):
    copy, src_side, dst_side = PATHS[path]
    src, dst = buffers[src_side][0], buffers[dst_side][1]
    data = refill(src, dst, seed)
    registry = kv.MemoryRegistry()
    registry.register_tensor("src", src.tensor)
    registry.register_tensor("dst", dst.tensor)
    s_off = np.array([c[0] for c in copies], np.int64)
    d_off = np.array([c[1] for c in copies], np.int64)
    n = np.array([c[2] for c in copies], np.int64)
    inside = all(0 <= a and 0 < z <= N and a <= N - z for a, z in zip(np.r_[s_off, d_off], np.r_[n, n]))
    stream = torch.cuda.Stream()
    try:
        result = copy(s_off + src.tensor.data_ptr(), d_off + dst.tensor.data_ptr(), n, stream,
                         registry=registry)
        stream.synchronize()
        assert inside and result.bytes == n.sum()
    except ValueError as e:
        assert not inside, e
    count = np.zeros(N, np.int64)  # writers of each byte; one written twice may hold either
    want = np.full(N, 0xA5, np.uint8)
    for a, b, z in zip(s_off, d_off, n) if inside else []:
        count[b : b + z] += 1
        want[b : b + z] = data[a : a + z]
    once = count <= 1
    np.testing.assert_array_equal(dst.tensor.cpu().numpy()[once], want[once])
    assert src.canaries_intact() and dst.canaries_intact()


@FUZZ
@given(st.lists(st.tuples(ids, ids), max_size=12), st.sampled_from(["host", "device"]), st.integers(0, 2**32))
def test_copy_blocks_on_the_gpu_with_hostile_mappings(buffers, pairs, src_side, seed):
    block = 1024
    src, dst = buffers[src_side][0], buffers["device"][1]
    data = refill(src, dst, seed).reshape(-1, block)
    mapping = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    blocks = N // block
    valid = mapping_is_valid(pairs, blocks, blocks)
    want = copied(data, np.full((blocks, block), 0xA5, np.uint8), pairs if valid else [])
    stream = torch.cuda.Stream()
    try:
        kv.copy_blocks(src.tensor.view(blocks, block), dst.tensor.view(blocks, block), mapping, stream)
        stream.synchronize()
        assert valid
    except ValueError as e:
        assert not valid and "block_mapping[" in str(e)
    np.testing.assert_array_equal(dst.tensor.view(blocks, block).cpu().numpy(), want)
    assert src.canaries_intact() and dst.canaries_intact()


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs, st.sampled_from(["pages", "pages_dma", "pages_kernel", "batch", "kernel", "staged"]))
def test_the_handler_on_the_gpu_with_hostile_jobs_keeps_working(hostile_jobs, method):
    guard = TorchGuardedBuffer(torch, 2 * 6 * 4096, "device")
    gpu = [[guard.tensor[t * 6 * 4096 : (t + 1) * 6 * 4096].view(6, 4096) for t in range(2)]]
    run_jobs(OffloadHandler(gpu, 4, 2, method=method), hostile_jobs)
    assert guard.canaries_intact()


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=8), st.integers(0, 8), st.integers(0, 8),
       st.integers(0, 2**32))
def test_copy_blocks_on_the_gpu_between_views_of_one_buffer(buffers, pairs, src_at, dst_at, seed):
    # src and dst are blocks [src_at, src_at + 8) and [dst_at, dst_at + 8) of one device buffer.
    buf = buffers["device"][1]
    data = np.random.default_rng(seed).integers(0, 256, N, dtype=np.uint8).reshape(16, -1)
    buf.tensor.copy_(torch.from_numpy(data.ravel()))
    torch.cuda.synchronize()
    whole = buf.tensor.view(16, -1)
    read, written = {src_at + s for s, _ in pairs}, {dst_at + d for _, d in pairs}
    valid = mapping_is_valid(pairs, 8, 8) and not read & written
    want = data.copy()
    for s, d in pairs if valid else []:
        want[dst_at + d] = data[src_at + s]
    stream = torch.cuda.Stream()
    try:
        kv.copy_blocks(whole[src_at:src_at + 8], whole[dst_at:dst_at + 8],
                       np.array(pairs, dtype=np.int64).reshape(-1, 2), stream)
        stream.synchronize()
        assert valid
    except ValueError as e:
        assert not valid and "block_mapping[" in str(e)
    np.testing.assert_array_equal(whole.cpu().numpy(), want)
    assert buf.canaries_intact()


@settings(max_examples=max(EXAMPLES // 6, 5), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs, jobs, st.sampled_from(["batch", "kernel", "staged"]))
def test_the_handler_on_the_gpu_with_hostile_jobs_from_two_threads(first, second, method):
    guard = TorchGuardedBuffer(torch, 2 * 6 * 4096, "device")
    gpu = [[guard.tensor[t * 6 * 4096 : (t + 1) * 6 * 4096].view(6, 4096) for t in range(2)]]
    handler = OffloadHandler(gpu, 4, 2, method=method)
    run_jobs_from_two_threads(handler, first, second)
    assert guard.canaries_intact()
