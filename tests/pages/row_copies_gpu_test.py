"""Strided DMA on the GPU: groups whose tensors are layers of one allocation (vLLM's
LBHNC) move a block, or a run of blocks, per 2D copy. Against the per-block model, on
random jobs with runs of consecutive ids, host breaks and padding; outputs poisoned
first, every buffer between canaries."""

import os

import numpy as np
import pytest
import torch

from canary import TorchGuardedBuffer
from kv_model import POISON, KVModel, check_cache
from kvoffload import _C
from kvoffload.pages.planner import chunks_used
from kvoffload.pages.table import page_table
from kvoffload.pool.layout import kv_layout, pool_bytes
from scale import scaled

LOAD, STORE = _C.Direction.LOAD, _C.Direction.STORE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
EXPANDABLE = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


class OneAllocation:
    """Per group, `tensors` layers of [blocks, page + padding] in one GPU buffer, `gap`
    bytes between layers (separate buffers with `separate`), and a poisoned pinned pool."""

    def __init__(self, rng, pages, tensors, blocks, chunks, bpc, cpu_layout, padding, gap=0, separate=False):
        self.pages, self.bpc = pages, bpc
        self.buffers, self.gpu = [], []
        for p, n in zip(pages, tensors):
            layer = blocks * (p + padding) + gap
            if separate:
                group = [TorchGuardedBuffer(torch, layer, "device") for _ in range(n)]
                views = [b.tensor[:blocks * (p + padding)].view(blocks, p + padding) for b in group]
            else:
                group = [TorchGuardedBuffer(torch, max(1, n) * layer, "device")]
                views = [group[0].tensor[i * layer:i * layer + blocks * (p + padding)].view(blocks, p + padding)
                         for i in range(n)]
            self.buffers += group
            self.gpu.append(views)
        for group in self.gpu:
            for t in group:
                t.copy_(torch.from_numpy(rng.integers(0, 256, tuple(t.shape), dtype=np.uint8)))
        self.rows = [[t.cpu().numpy().copy() for t in group] for group in self.gpu]
        page_lists = [[p] * n for p, n in zip(pages, tensors)]
        self.pool = TorchGuardedBuffer(torch, pool_bytes(page_lists, [chunks] * len(pages), bpc), "host")
        self.pool.tensor.fill_(POISON)
        self.layout = kv_layout(self.gpu, page_lists, [chunks] * len(pages), bpc, self.pool.tensor.data_ptr(),
                                cpu_layout)
        self.model = KVModel([[r[:, :p] for r in group] for p, group in zip(pages, self.rows)],
                             [chunks] * len(pages), bpc)

    def check(self):
        check_cache(self, self.buffers)


def pool_ids(rng, count, n):
    """n distinct ids of `count`, in runs of consecutive ids (as vLLM's block pool hands
    them out), the runs shuffled."""
    run = int(rng.integers(1, 9))
    runs = [list(range(i, min(count, i + run))) for i in range(0, count, run)]
    order = rng.permutation(len(runs))
    return np.array([i for k in order for i in runs[k]][:n], dtype=np.int64)


def random_job(rng, cache, chunks, runs):
    sizes, firsts, ids, chunk_ids = [], [], [], []
    for group in cache.layout.groups:
        first = int(rng.integers(0, 2 * cache.bpc))
        n = int(rng.integers(0, min(group.num_gpu_blocks, chunks * cache.bpc - first % cache.bpc) + 1))
        used = chunks_used(n, first, cache.bpc)
        sizes.append(n)
        firsts.append(first)
        ids.append(pool_ids(rng, group.num_gpu_blocks, n) if runs else rng.permutation(group.num_gpu_blocks)[:n])
        chunk_ids.append(pool_ids(rng, chunks, used) if runs else rng.permutation(chunks)[:used])
    return np.concatenate(ids).astype(np.int64), np.concatenate(chunk_ids).astype(np.int64), sizes, firsts


@pytest.mark.parametrize("seed", range(scaled(12)))
def test_one_allocation_moves_as_the_model_says(seed):
    rng = np.random.default_rng(seed)
    pages = [int(rng.choice([16, 48, 4096, 8192, 40 << 10])) for _ in range(int(rng.integers(1, 4)))]
    tensors = [int(rng.integers(1, 6)) for _ in pages]
    bpc, chunks, blocks = int(rng.integers(1, 4)), 12, 28
    cpu_layout = ["chunk_major", "per_tensor"][seed % 2]
    cache = OneAllocation(rng, pages, tensors, blocks, chunks, bpc, cpu_layout, padding=int(rng.choice([0, 16])),
                          gap=int(rng.choice([0, 256])))
    # Host breaks at some chunks' starts: no 2D copy may span two registrations.
    breaks = sorted({t.cpu_base + int(c) * t.cpu_stride for g in cache.layout.groups for t in g.tensors
                     for c in rng.choice(chunks, 2)}) if seed % 3 == 0 else []
    table = page_table(cache.layout, breaks)
    rows = table.rows(torch.cuda.current_device())
    for group, (strided, why_not, n, gpu_pitch, host_pitch) in zip(cache.layout.groups, rows):
        assert n == len(group.tensors)
        # Under expandable segments the driver's range is one mapped handle: refused, by name.
        assert strided == (n >= 2) or (EXPANDABLE and why_not == "the GPU tensors are not one allocation"), why_not
    stream = torch.cuda.Stream()
    for step in range(6):
        ids, chunk_ids, sizes, firsts = random_job(rng, cache, chunks, runs=step % 3 != 0)
        load = step % 2 == 1
        # Every other pair of steps sends the 2D copies many to a driver call; every third
        # step cuts them into bands of one to three rows; some carry the hint to overlap.
        result = table.copy(ids, chunk_ids, sizes, firsts, direction=LOAD if load else STORE, stream=stream,
                            path=_C.PagePath.DMA, row_batches=(seed + step // 2) % 2 == 1,
                            rows_per_copy=int(rng.integers(1, 4)) if step % 3 == 1 else 0,
                            prefer_overlap=(seed + step) % 4 == 3)
        getattr(cache.model, "load" if load else "store")(ids, sizes, firsts, chunk_ids)
        assert result.bytes == sum(p * n * k for p, n, k in zip(pages, sizes, tensors))
        cache.check()


@pytest.mark.skipif(EXPANDABLE, reason="under expandable segments the driver refuses rows")
def test_runs_of_blocks_go_as_one_copy_and_separate_allocations_go_per_page():
    rng = np.random.default_rng(7)
    # 40 chunks over 32 blocks: the host pitch is not the GPU's, so swapped pitches show.
    cache = OneAllocation(rng, [8192], [6], 32, 40, 1, "per_tensor", padding=0)
    table = page_table(cache.layout)
    assert table.rows(torch.cuda.current_device())[0] == (True, "", 6, 32 * 8192, 40 * 8192)
    stream = torch.cuda.Stream()
    ids, chunk_ids = np.arange(4, 20, dtype=np.int64), np.arange(8, 24, dtype=np.int64)
    result = table.copy(ids, chunk_ids, [16], [0], direction=STORE, stream=stream, path=_C.PagePath.DMA)
    cache.model.store(ids, [16], [0], chunk_ids)
    assert (result.path, result.copies, result.driver_calls) == ("rows", 1, 1)
    cache.check()
    # In a cuMemcpy3DBatchAsync call, to chunks still poisoned: the same one copy.
    fresh = np.arange(24, 40, dtype=np.int64)
    result = table.copy(ids, fresh, [16], [0], direction=STORE, stream=stream, path=_C.PagePath.DMA,
                        row_batches=True)
    cache.model.store(ids, [16], [0], fresh)
    assert (result.path, result.copies, result.driver_calls) == ("rows", 1, 1)
    cache.check()
    # Loaded in bands of four rows into blocks that hold other bytes: two copies (rows 0-3
    # and 4-5), the run still merged in each.
    into, source = np.arange(20, 32, dtype=np.int64), np.arange(8, 20, dtype=np.int64)
    result = table.copy(into, source, [12], [0], direction=LOAD, stream=stream, path=_C.PagePath.DMA,
                        rows_per_copy=4)
    cache.model.load(into, [12], [0], source)
    assert (result.path, result.copies) == ("rows", 2)
    cache.check()
    with pytest.raises(ValueError, match="rows_per_copy: must be >= 0"):
        table.copy(ids, chunk_ids, [16], [0], direction=STORE, stream=stream, path=_C.PagePath.DMA,
                   rows_per_copy=-1)
    # The same job per page: one batch call, six copies (one per layer, the run merged).
    result = table.copy(ids, chunk_ids, [16], [0], direction=LOAD, stream=stream, path=_C.PagePath.DMA,
                        strided=False)
    cache.model.load(ids, [16], [0], chunk_ids)
    assert (result.path, result.copies) == ("batch", 6)
    cache.check()

    # Layers of 12 MiB apiece, each its own buffer: whether the caching allocator places
    # them apart, backwards or in separate cudaMallocs, they are no rows of one copy.
    apart = OneAllocation(rng, [8192], [3], 1536, 16, 1, "per_tensor", padding=0, separate=True)
    rows = page_table(apart.layout).rows(torch.cuda.current_device())
    assert not rows[0][0] and rows[0][1], rows
    result = page_table(apart.layout).copy(np.arange(4), np.arange(4), [4], [0], direction=STORE, stream=stream,
                                           path=_C.PagePath.DMA)
    apart.model.store(np.arange(4), [4], [0], np.arange(4))
    assert result.path == "batch"
    apart.check()
