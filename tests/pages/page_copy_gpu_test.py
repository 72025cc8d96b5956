"""Id-addressed page copies on the GPU (kvoffload.pages.table): staged and direct, loads
and stores, on random multi-group layouts, against the per-block model; every
destination between canaries, outputs poisoned first."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvoffload as kv
from canary import TorchGuardedBuffer
from kv_model import POISON, KVModel, check_cache
from kvoffload import _C
from kvoffload.pages.planner import chunks_used
from kvoffload.pages.table import UNIT_BYTES, page_table
from kvoffload.pool.layout import kv_layout, pool_bytes
from scale import scaled

LOAD, STORE = _C.Direction.LOAD, _C.Direction.STORE

PATHS = (_C.PagePath.STAGED, _C.PagePath.KERNEL, _C.PagePath.DMA)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


class Cache:
    """GPU tensors [blocks, page + padding] of random bytes and a poisoned pinned pool,
    each between canaries, with the model of what they must hold."""

    def __init__(self, rng, pages, tensors, blocks, chunks, bpc, cpu_layout, padding):
        self.pages, self.bpc, self.padding = pages, bpc, padding
        self.gpu_buffers = [[TorchGuardedBuffer(torch, blocks * (p + padding), "device")
                             for _ in range(n)] for p, n in zip(pages, tensors)]
        self.gpu = [[b.tensor.view(blocks, p + padding) for b in group]
                    for p, group in zip(pages, self.gpu_buffers)]
        for group in self.gpu:
            for t in group:
                t.copy_(torch.from_numpy(rng.integers(0, 256, tuple(t.shape), dtype=np.uint8)))
        self.rows = [[t.cpu().numpy().copy() for t in group] for group in self.gpu]
        page_lists = [[p] * n for p, n in zip(pages, tensors)]
        self.pool = TorchGuardedBuffer(torch, pool_bytes(page_lists, [chunks] * len(pages), bpc), "host")
        self.pool.tensor.fill_(POISON)
        self.layout = kv_layout(self.gpu, page_lists, [chunks] * len(pages), bpc,
                                self.pool.tensor.data_ptr(), cpu_layout)
        self.table = page_table(self.layout)
        self.model = KVModel([[r[:, :p] for r in group] for p, group in zip(pages, self.rows)],
                             [chunks] * len(pages), bpc)

    def check(self):
        check_cache(self, [b for group in self.gpu_buffers for b in group])


def random_job(rng, cache, chunks):
    """Random blocks of every group (none for a group without tensors), from a random
    first logical index."""
    sizes, firsts, ids, chunk_ids = [], [], [], []
    for group in cache.layout.groups:
        first = int(rng.integers(0, 2 * cache.bpc))
        most = min(group.num_gpu_blocks, chunks * cache.bpc - first % cache.bpc)
        n = int(rng.integers(0, most + 1))
        sizes.append(n)
        firsts.append(first)
        ids.append(rng.permutation(group.num_gpu_blocks)[:n])
        chunk_ids.append(rng.permutation(chunks)[: chunks_used(n, first, cache.bpc)])
    return np.concatenate(ids).astype(np.int64), np.concatenate(chunk_ids).astype(np.int64), sizes, firsts


@settings(max_examples=scaled(40), deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       pages=st.lists(st.sampled_from([16, 40, 4096, 4096 + 48, UNIT_BYTES + 16, 2 * UNIT_BYTES]),
                      min_size=1, max_size=3),
       bpc=st.integers(1, 4), cpu_layout=st.sampled_from(["chunk_major", "per_tensor"]),
       padding=st.sampled_from([0, 16, 24]), path=st.sampled_from(list(PATHS)),
       slot_bytes=st.sampled_from([UNIT_BYTES, 3 * UNIT_BYTES + 256, 64 << 20]),
       slots=st.integers(2, 3), ctas=st.sampled_from([1, 4, 32]))
def test_random_jobs_match_the_model(seed, pages, bpc, cpu_layout, padding, path, slot_bytes,
                                     slots, ctas):
    rng = np.random.default_rng(seed)
    tensors = [int(rng.integers(0, 4)) for _ in pages]
    blocks, chunks = 24, 10
    cache = Cache(rng, pages, tensors, blocks, chunks, bpc, cpu_layout, padding)
    stream = torch.cuda.Stream()
    for step in range(4):
        ids, chunk_ids, sizes, firsts = random_job(rng, cache, chunks)
        load = step % 2 == 1
        result = cache.table.copy(ids, chunk_ids, sizes, firsts, direction=LOAD if load else STORE, stream=stream,
                                  path=path, max_ctas=ctas, slot_bytes=slot_bytes, slots=slots)
        getattr(cache.model, "load" if load else "store")(ids, sizes, firsts, chunk_ids)
        expected = sum(p * n * k for p, n, k in zip(pages, sizes, tensors))
        assert result.bytes == expected
        cache.check()


@pytest.mark.parametrize("slot_bytes,slots", [(UNIT_BYTES, 2), (3 * UNIT_BYTES + 256, 3), (8 << 20, 2)])
def test_a_ring_held_in_l2_copies_what_the_model_does(slot_bytes, slots):
    rng = np.random.default_rng(slots + slot_bytes)
    cache = Cache(rng, [4096, UNIT_BYTES + 16], [3, 2], 32, 12, 2, "chunk_major", 16)
    stream = torch.cuda.Stream()
    for step in range(scaled(8)):
        ids, chunk_ids, sizes, firsts = random_job(rng, cache, 12)
        load = step % 2 == 1
        cache.table.copy(ids, chunk_ids, sizes, firsts, direction=LOAD if load else STORE, stream=stream,
                         slot_bytes=slot_bytes, slots=slots, slots_in_l2=True)
        getattr(cache.model, "load" if load else "store")(ids, sizes, firsts, chunk_ids)
        cache.check()


def test_a_ring_larger_than_persisting_l2_is_refused_before_it_copies():
    rng = np.random.default_rng(5)
    cache = Cache(rng, [4096], [2], 16, 8, 2, "chunk_major", 0)
    most = torch.cuda.get_device_properties(0).L2_cache_size
    with pytest.raises(ValueError, match=r"slot_bytes: slots x slot_bytes .* persisting L2"):
        cache.table.copy(np.arange(8), np.arange(4), [8], [0], direction=LOAD, stream=torch.cuda.Stream(),
                         slot_bytes=most, slots=2, slots_in_l2=True)
    torch.cuda.synchronize()
    cache.check()


def test_a_handler_refuses_a_ring_larger_than_persisting_l2_when_it_is_made():
    too_large = torch.cuda.get_device_properties(0).L2_cache_size  # two: more than all of L2
    method = kv.Pages(kv.PagePath.STAGED, slot_bytes=too_large, slots=2, slots_in_l2=True)
    with pytest.raises(ValueError, match=r"slot_bytes: slots x slot_bytes .* persisting L2"):
        kv.OffloadHandler([[torch.zeros(16, 4096, dtype=torch.int8, device="cuda")]], num_cpu_chunks=4,
                          blocks_per_chunk=4, method=method)


@pytest.mark.parametrize("path", PATHS)
def test_loads_and_stores_in_flight_at_once_on_disjoint_blocks(path):
    rng = np.random.default_rng(3)
    cache = Cache(rng, [4096], [4], 256, 64, 4, "chunk_major", 0)
    store_stream, load_stream = torch.cuda.Stream(), torch.cuda.Stream()
    cache.table.copy(np.arange(0, 128), np.arange(0, 32), [128], [0], direction=STORE,
                     stream=store_stream, path=path, slot_bytes=UNIT_BYTES * 4)
    torch.cuda.synchronize()
    cache.model.store(np.arange(0, 128), [128], [0], np.arange(0, 32))
    for _ in range(scaled(5)):
        cache.table.copy(np.arange(128, 256), np.arange(32, 64), [128], [0], direction=STORE,
                         stream=store_stream, path=path, slot_bytes=UNIT_BYTES * 4)
        cache.table.copy(np.arange(128)[::-1].copy(), np.arange(0, 32), [128], [0], direction=LOAD,
                         stream=load_stream, path=path, slot_bytes=UNIT_BYTES * 4)
    cache.model.store(np.arange(128, 256), [128], [0], np.arange(32, 64))
    cache.model.load(np.arange(128)[::-1].copy(), [128], [0], np.arange(0, 32))
    cache.check()


def test_stream_order_a_load_after_a_store_reads_what_it_wrote():
    rng = np.random.default_rng(4)
    cache = Cache(rng, [8192], [2], 64, 16, 4, "per_tensor", 0)
    stream = torch.cuda.Stream()
    for _ in range(scaled(10)):
        ids = rng.permutation(64)[:16]
        chunks = rng.permutation(16)[:4]
        cache.table.copy(ids, chunks, [16], [0], direction=STORE, stream=stream, slot_bytes=UNIT_BYTES)
        back = rng.permutation(64)[:16]
        cache.table.copy(back, chunks, [16], [0], direction=LOAD, stream=stream, slot_bytes=UNIT_BYTES)
        cache.model.store(ids, [16], [0], chunks)
        cache.model.load(back, [16], [0], chunks)
    cache.check()


def test_a_copy_on_another_ring_does_not_queue_behind_a_blocked_ring():
    # Ring 0 starts after its caller's stream, held here by a long spin; a second copy on
    # ring 0 queues behind it, one on ring 1 (as expedited loads use) does not.
    rng = np.random.default_rng(6)
    cache = Cache(rng, [4096], [2], 64, 16, 4, "chunk_major", 0)
    held, behind, own = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    # A process's first page copy waits for the work enqueued on the device (README):
    # both rings copy once before the spin.
    for ring in (0, 1):
        cache.table.copy([0], [0], [1], [0], direction=LOAD, stream=own, ring=ring)
        cache.model.load([0], [1], [0], [0])
    own.synchronize()
    with torch.cuda.stream(held):
        torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU cycles
    blocks = rng.permutation(64)  # disjoint: the copies land in another order than submitted
    jobs = [(blocks[8 * i:8 * i + 8], rng.permutation(16)[:2]) for i in range(3)]
    for (ids, chunks), stream, ring in zip(jobs, (held, behind, own), (0, 0, 1)):
        cache.table.copy(ids, chunks, [8], [0], direction=LOAD, stream=stream, ring=ring)
    own.synchronize()
    assert not held.query() and not behind.query()
    torch.cuda.synchronize()
    for ids, chunks in jobs:
        cache.model.load(ids, [8], [0], chunks)
    cache.check()
    with pytest.raises(ValueError, match=r"ring: must be in \[0, 4\), got 4"):
        cache.table.copy([0], [0], [1], [0], direction=LOAD, stream=own, ring=4)


def test_any_source_order_is_refused_but_for_dma_loads_before_anything_is_copied():
    rng = np.random.default_rng(9)
    cache = Cache(rng, [4096], [2], 16, 8, 2, "chunk_major", 0)
    stream = torch.cuda.Stream()
    for load, path in ((False, _C.PagePath.DMA), (True, _C.PagePath.STAGED), (True, _C.PagePath.KERNEL)):
        with pytest.raises(ValueError, match="src_order: ANY is for DMA loads only"):
            cache.table.copy([3], [1], [1], [0], direction=LOAD if load else STORE, stream=stream, path=path,
                             src_order=_C.SrcAccessOrder.ANY)
    with pytest.raises(ValueError, match="src_order: must be STREAM or ANY"):
        cache.table.copy([3], [1], [1], [0], direction=LOAD, stream=stream, path=_C.PagePath.DMA,
                         src_order=_C.SrcAccessOrder.DURING_API_CALL)
    stream.synchronize()
    cache.check()  # nothing moved
    cache.table.copy([3, 5], [1], [2], [0], direction=STORE, stream=stream, path=_C.PagePath.DMA)
    stream.synchronize()
    cache.model.store([3, 5], [2], [0], [1])
    cache.table.copy([7, 9], [1], [2], [0], direction=LOAD, stream=stream, path=_C.PagePath.DMA,
                     src_order=_C.SrcAccessOrder.ANY)
    stream.synchronize()
    cache.model.load([7, 9], [2], [0], [1])
    cache.check()


def test_bad_ids_enqueue_nothing():
    rng = np.random.default_rng(5)
    cache = Cache(rng, [4096], [2], 16, 8, 2, "chunk_major", 0)
    stream = torch.cuda.Stream()
    for ids, chunks, message in (([0, 16], [0], "out of range"), ([3, 3], [0], "appears twice"),
                                 ([0, 1], [9], "out of range"), ([0, 1], [], "chunk_ids: has 0")):
        with pytest.raises(ValueError, match=message):
            cache.table.copy(ids, chunks, [2], [0], direction=LOAD, stream=stream)
    cache.check()


def test_pageable_pool_and_foreign_memory_are_refused():
    gpu = torch.zeros(8, 4096, dtype=torch.uint8, device="cuda")
    pageable = torch.zeros(8 * 4096, dtype=torch.uint8)
    layout = kv_layout([[gpu]], [[4096]], [8], 1, pageable.data_ptr(), "chunk_major")
    with pytest.raises(ValueError, match="cpu_base.*pageable"):
        page_table(layout).copy([0], [0], [1], [0], direction=LOAD, stream=torch.cuda.Stream())
    cpu = torch.zeros(8 * 4096, dtype=torch.uint8).pin_memory()
    layout = kv_layout([[cpu.view(8, 4096)]], [[4096]], [8], 1, cpu.data_ptr(), "chunk_major")
    with pytest.raises(ValueError, match="gpu_base"):
        page_table(layout).copy([0], [0], [1], [0], direction=LOAD, stream=torch.cuda.Stream())


def test_legacy_and_per_thread_streams():
    rng = np.random.default_rng(6)
    cache = Cache(rng, [4096], [1], 8, 8, 1, "chunk_major", 0)
    for stream in (None, 2, torch.cuda.current_stream()):
        ids = rng.permutation(8)[:4]
        chunks = rng.permutation(8)[:4]
        cache.table.copy(ids, chunks, [4], [0], direction=STORE, stream=stream)
        cache.model.store(ids, [4], [0], chunks)
        cache.check()
    assert kv.batch_entry_point_version() >= 0
