"""vLLM KV caches for the tests of kvoffload.vllm: int8 tensors of random bytes wrapped
in vLLM's canonical classes, jobs named as vLLM's scheduler names them, and the flows
that the CPU and GPU tests both run."""

import time

import vllm_env  # noqa: F401  (puts vLLM on sys.path)
import numpy as np
import torch
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
                                     CanonicalPageMapping, CopyRun, GPULoadStoreSpec)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvoffload.pages.planner import chunks_used
from kvoffload.vllm import KVOffloadWorker

POISON = -91

CASES = {
    # name: (rows, refs per group, blocks moved per group, blocks_per_chunk)
    "one group, 4 tensors": ([256] * 4, [[(0, 256), (1, 256), (2, 256), (3, 256)]], [13], 4),
    "one block per chunk": ([96, 96], [[(0, 96), (1, 96)]], [9], 1),
    "groups [n, 0, n], 3 x 2 tensors": ([128] * 6, [[(0, 128), (1, 128)], [(2, 128), (3, 128)],
                                                    [(4, 128), (5, 128)]], [7, 0, 7], 3),
    "hybrid: groups share tensors, pages differ in a padded row":
        ([192, 192], [[(0, 192), (1, 192)], [(0, 128), (1, 128)]], [6, 9], 2),
}


class VllmCache:
    """tensors[i]: [num_blocks, rows[i]] random int8; refs[g]: [(tensor index, unpadded page)]."""

    def __init__(self, rng, rows, refs, num_blocks, device="cpu"):
        self.tensors = [torch.from_numpy(rng.integers(-128, 128, (num_blocks, row), dtype=np.int8))
                        .to(device) for row in rows]
        self.refs = refs
        self.kv_caches = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, row) for t, row in zip(self.tensors, rows)],
            [[CanonicalKVCacheRef(i, page) for i, page in group] for group in refs])

    def snapshot(self):
        return [t.clone() for t in self.tensors]

    def poison(self, group, blocks):
        for i, page in self.refs[group]:
            self.tensors[i][torch.as_tensor(blocks, device=self.tensors[i].device), :page] = POISON

    def assert_blocks(self, snapshot, group, src_blocks, dst_blocks):
        """dst_blocks of group now hold what src_blocks held in snapshot, page by page."""
        for i, page in self.refs[group]:
            src = torch.as_tensor(src_blocks, device=snapshot[i].device)
            dst = torch.as_tensor(dst_blocks, device=self.tensors[i].device)
            assert torch.equal(self.tensors[i][dst, :page].cpu(), snapshot[i][src, :page].cpu()), \
                f"group {group} tensor {i}: loaded bytes differ"

    def page_bytes(self, group):
        return sum(page for _, page in self.refs[group])


def job(blocks, first_indices, chunks, bpc):
    """vLLM's specs for blocks[g] at logical index first_indices[g], into the leading
    chunks_used chunks of chunks[g]."""
    used = [chunks_used(len(b), f, bpc) for b, f in zip(blocks, first_indices)]
    gpu = GPULoadStoreSpec(np.concatenate(blocks).astype(np.int64).tolist(),
                           [len(b) for b in blocks], list(first_indices))
    cpu = CPULoadStoreSpec(np.concatenate([c[:n] for c, n in zip(chunks, used)]).astype(np.int64).tolist())
    return gpu, cpu


def finish(worker, job_ids, started, timeout=60.0):
    """Polls get_finished until every job is reported; {job_id: result}. Checks each
    time against the wall time since ``started``."""
    results = {}
    while set(results) != set(job_ids):
        assert time.perf_counter() - started < timeout, f"jobs {set(job_ids) - set(results)} never finished"
        for r in worker.get_finished():
            assert r.job_id in job_ids and r.job_id not in results, r
            results[r.job_id] = r
        time.sleep(0.001)
    elapsed = time.perf_counter() - started
    for r in results.values():
        assert r.success, r
        assert 0 < r.transfer_time < elapsed, (r.transfer_time, elapsed)
    return results


def round_trip(rng, cache, bpc, num_chunks, n, before_shutdown=None, **options):
    """Stores n random blocks of every non-empty group at a logical index inside a chunk,
    poisons other blocks and loads the chunks back into them in two jobs split at a random
    block: the bytes, sizes and times must be right. before_shutdown(worker) runs last."""
    worker = KVOffloadWorker(cache.kv_caches, bpc, num_chunks, **options)
    groups, num_blocks = len(cache.refs), cache.tensors[0].shape[0]
    # Block ids are unique across groups, as in vLLM's one block pool; so are chunk ids.
    blocks = _slices(rng.permutation(num_blocks), list(n) + list(n))
    src, dst = blocks[:groups], blocks[groups:]
    first = [int(rng.integers(1, bpc)) if bpc > 1 else 0 for _ in range(groups)]
    chunks = _slices(rng.permutation(num_chunks),
                     [chunks_used(k, f, bpc) for k, f in zip(n, first)])
    snapshot = cache.snapshot()
    gpu, cpu = job(src, first, chunks, bpc)
    started = time.perf_counter()
    assert worker.submit_store(1, gpu, cpu)
    stored = finish(worker, {1}, started)[1]
    assert stored.transfer_size == sum(n[g] * cache.page_bytes(g) for g in range(groups))

    for g in range(groups):
        cache.poison(g, dst[g])
    after_store = cache.snapshot()
    split = [int(rng.integers(0, k + 1)) for k in n]
    jobs = []
    for part in (0, 1):
        blocks = [d[:s] if part == 0 else d[s:] for d, s in zip(dst, split)]
        firsts = [f if part == 0 else f + s for f, s in zip(first, split)]
        skip = [(f % bpc + (0 if part == 0 else s)) // bpc for f, s in zip(first, split)]
        gpu, cpu = job(blocks, firsts, [c[k:] for c, k in zip(chunks, skip)], bpc)
        jobs.append((10 + part, gpu, cpu))
    started = time.perf_counter()
    for job_id, gpu, cpu in jobs:
        assert worker.submit_load(job_id, cpu, gpu, expedited=job_id == 11)
    loaded = finish(worker, {10, 11}, started)
    assert sum(r.transfer_size for r in loaded.values()) == stored.transfer_size
    for g in range(groups):
        cache.assert_blocks(snapshot, g, src[g], dst[g])
    untouched = torch.as_tensor(np.setdiff1d(np.arange(num_blocks), np.concatenate(dst)))
    for i, t in enumerate(cache.tensors):
        assert torch.equal(t.cpu()[untouched], after_store[i].cpu()[untouched]), \
            f"tensor {i}: a block not loaded changed"
    for g in range(groups):
        for i, page in cache.refs[g]:
            rows = torch.as_tensor(dst[g])
            assert torch.equal(cache.tensors[i].cpu()[rows, page:], after_store[i].cpu()[rows, page:]), \
                f"group {g} tensor {i}: a load wrote past the unpadded page"
    if before_shutdown is not None:
        before_shutdown(worker)
    worker.shutdown()
    return worker


def _slices(values, counts):
    at = np.cumsum([0] + list(counts))
    return [values[at[k]:at[k + 1]] for k in range(len(counts))]


def tp2_mapping(rank):
    """A layer of 2 KV heads per rank as vLLM maps it at TP 2 (NHD): per token, this rank's
    128 bytes of K (then of V) go beside the other rank's in a 2048-byte canonical page."""
    return CanonicalPageMapping(2048, 1024, (CopyRun(0, rank * 128, 128, 4, 128, 256),
                                             CopyRun(512, 1024 + rank * 128, 128, 4, 128, 256)), 1, 0, True)


def canonical_page(locals_by_rank, mappings, size):
    """The oracle: the canonical page the ranks' local pages make, run by run."""
    page = np.full(size, POISON & 0xFF, np.uint8)
    for local, m in zip(locals_by_rank, mappings):
        for run in m.runs:
            for k in range(run.num_fragments):
                lo, co = run.local_offset + k * run.local_stride, run.canonical_offset + k * run.canonical_stride
                page[co:co + run.fragment_size] = local[lo:lo + run.fragment_size]
    return page
