"""kvoffload.vllm.KVOffloadRegionWorker on a GPU: vLLM's SharedOffloadRegion as the pool,
with whole pages and with canonical fragments, each region made as KVOffloadTieringSpec
makes it (the spec itself needs vLLM's config, which the light bundle lacks)."""

import os
import time

import numpy as np
import pytest
import torch

from vllm_cache import POISON, canonical_page, finish, tp2_mapping
from vllm.utils.math_utils import round_up
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from kvoffload.vllm import KVOffloadRegionWorker

DEVICE = os.environ.get("KVOFFLOAD_REGION_TEST_DEVICE", "cuda")  # "cpu" runs the same flows on host lanes
BLOCKS, CHUNKS = 64, 48


def region(engine, rank, chunk_bytes, page_bytes):
    """What the tiering spec's create_worker makes for ``rank``: rows of ``chunk_bytes``
    rounded up to vLLM's alignment, ``page_bytes`` of them this rank's slot."""
    return SharedOffloadRegion(engine_id=engine, num_chunks=CHUNKS, rank=rank,
                               kv_bytes_per_chunk=round_up(chunk_bytes, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT),
                               cpu_page_size=page_bytes)


def engine_id(name):
    return f"kvoffload-region-test-{name}-{os.getpid()}-{time.monotonic_ns()}"


def rows_of(r):
    """The region's rows as numpy bytes (CHUNKS x row stride)."""
    return r.base_tensor.numpy().view(np.uint8).reshape(CHUNKS, -1)


def random_tensors(rng, widths):
    return [torch.from_numpy(rng.integers(-128, 128, (BLOCKS, w), dtype=np.int8)).to(DEVICE) for w in widths]


def store_and_check(worker, job_id, blocks, chunks):
    started = time.perf_counter()
    assert worker.submit_store(job_id, GPULoadStoreSpec(blocks.tolist(), [len(blocks)], [0]),
                               CPULoadStoreSpec(chunks.tolist()))
    finish(worker, {job_id}, started)


def load_and_check(worker, job_id, chunks, targets):
    started = time.perf_counter()
    assert worker.submit_load(job_id, CPULoadStoreSpec(chunks.tolist()),
                              GPULoadStoreSpec(targets.tolist(), [len(targets)], [0]))
    finish(worker, {job_id}, started)


@pytest.mark.parametrize("method", ["pages", "pages_staged", "pages_dma"])
def test_whole_pages_land_where_vllms_views_have_them_and_load_back(method):
    rng = np.random.default_rng(1)
    widths = [8192, 4096, 16384]  # page bytes of three layers; a row holds them side by side
    tensors = random_tensors(rng, widths)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, w) for t, w in zip(tensors, widths)],
                               [[CanonicalKVCacheRef(i, w) for i, w in enumerate(widths)]])
    r = region(engine_id("pages"), 0, sum(widths), sum(widths))
    rows_of(r)[:] = POISON & 0xFF
    worker = KVOffloadRegionWorker(caches, 1, CHUNKS, r, method=method)
    blocks, chunks = rng.permutation(BLOCKS)[:12], rng.permutation(CHUNKS)[:12]
    snapshot = [t.cpu().numpy().view(np.uint8) for t in tensors]
    store_and_check(worker, 1, blocks, chunks)
    rows = rows_of(r)
    at = np.cumsum([0] + widths)
    for k, (b, c) in enumerate(zip(blocks, chunks)):
        for i in range(len(widths)):
            assert np.array_equal(rows[c, at[i]:at[i + 1]], snapshot[i][b]), (k, i)
    untouched = np.setdiff1d(np.arange(CHUNKS), chunks)
    assert (rows[untouched] == POISON & 0xFF).all(), "a store wrote a chunk it was not given"
    targets = np.setdiff1d(np.arange(BLOCKS), blocks)[:12]
    for t in tensors:
        t[torch.as_tensor(targets).to(DEVICE)] = POISON
    load_and_check(worker, 2, chunks, targets)
    for i, t in enumerate(tensors):
        assert np.array_equal(t[torch.as_tensor(targets).to(DEVICE)].cpu().numpy().view(np.uint8),
                              snapshot[i][blocks]), i
    del rows
    worker.shutdown()


def test_canonical_pages_are_two_ranks_fragments_side_by_side_and_load_back():
    rng = np.random.default_rng(2)
    engine = engine_id("canonical")
    # Two ranks of two layers of 1024-byte local pages: rows of 2 x 2048 canonical bytes.
    regions = [region(engine, rank, 2 * 2 * 1024, 2 * 1024) for rank in range(2)]
    rows_of(regions[0])[:] = POISON & 0xFF
    tensors = [random_tensors(np.random.default_rng(20 + rank), [1024, 1024]) for rank in range(2)]
    workers = [KVOffloadRegionWorker(
        CanonicalKVCaches([CanonicalKVCacheTensor(t, 1024) for t in tensors[rank]],
                          [[CanonicalKVCacheRef(i, 1024, tp2_mapping(rank)) for i in range(2)]]),
        1, CHUNKS, regions[rank], canonical_layout=True) for rank in range(2)]
    assert [len(g) for g in workers[0].handler.gpu_tensors] == [2 * 2 * 4], "a tensor per fragment"
    blocks, chunks = rng.permutation(BLOCKS)[:6], rng.permutation(CHUNKS)[:6]
    snapshots = [[t.cpu().numpy().view(np.uint8) for t in tensors[rank]] for rank in range(2)]
    for rank, w in enumerate(workers):
        store_and_check(w, rank, blocks, chunks)
    rows = rows_of(regions[1])  # rank 1's mapping of the same file
    for k, (b, c) in enumerate(zip(blocks, chunks)):
        for layer in range(2):
            want = canonical_page([snapshots[rank][layer][b] for rank in range(2)],
                                  [tp2_mapping(rank) for rank in range(2)], 2048)
            assert np.array_equal(rows[c, layer * 2048:(layer + 1) * 2048], want), (k, layer)
    targets = np.setdiff1d(np.arange(BLOCKS), blocks)[:6]
    for rank, w in enumerate(workers):
        for t in tensors[rank]:
            t[torch.as_tensor(targets).to(DEVICE)] = POISON
        load_and_check(w, 10 + rank, chunks, targets)
        for layer, t in enumerate(tensors[rank]):
            got = t[torch.as_tensor(targets).to(DEVICE)].cpu().numpy().view(np.uint8)
            assert np.array_equal(got, snapshots[rank][layer][blocks]), (rank, layer)
    del rows
    for w in workers:
        w.shutdown()
