"""kvoffload's vLLM worker on the caches vLLM itself allocates (bench/vllm_caches.py: its
planner, allocate_kv_cache and register_kv_caches), in every layout, with block ids from
vLLM's block pool: the bytes land where vLLM's own formula puts them, on CPU and, where
there is one, on the GPU, whose DMA takes 2D copies on one allocation."""

import os

import numpy as np
import pytest
import torch

import vllm_caches
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvoffload.pages import paths as page_paths
from kvoffload.vllm import KVOffloadWorker

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MODELS = ["tp8-8k", "hybrid", "mla-16"]
BLOCKS = 96
needs_vllms_code = pytest.mark.skipif(not vllm_caches.vllms_code_runs(),
                                      reason="vLLM's engine config does not import here (the light bundle)")


def layer_bytes(backing, tensor, layer, block, page):
    """Layer ``layer`` of block ``block`` where vLLM's allocate_kv_cache says it starts."""
    at = tensor.offset + layer * tensor.layer_stride + block * tensor.block_stride
    return backing[at:at + page]


@needs_vllms_code
@pytest.mark.parametrize("kv_layout", ["LBHNC", "BLHNC", "LBNHC"])
def test_the_worker_sees_vllms_one_allocation(kv_layout):
    caches, (backing,), tensor = vllm_caches.canonical_caches(torch, "tp8-8k", kv_layout, BLOCKS, "cpu")
    page = vllm_caches.page_bytes(torch, "tp8-8k")
    views = [t.tensor for t in caches.tensors]
    assert {v.untyped_storage().data_ptr() for v in views} == {backing.untyped_storage().data_ptr()}
    if kv_layout == "BLHNC":  # one packed tensor, its page the whole block across all 80 layers
        assert len(views) == 1 and views[0].shape == (BLOCKS, 80 * page) and tensor.block_stride == 80 * page
    else:
        assert len(views) == 80 and all(v.shape == (BLOCKS, page) for v in views)
        assert {b.data_ptr() - a.data_ptr() for a, b in zip(views, views[1:])} == {tensor.layer_stride}
    rng = np.random.default_rng(3)
    for layer, block in zip(rng.integers(0, 80, 20), rng.integers(0, BLOCKS, 20)):
        got = (views[0][block, layer * page:(layer + 1) * page] if kv_layout == "BLHNC" else views[layer][block])
        assert torch.equal(got, layer_bytes(backing, tensor, layer, block, page))


@needs_vllms_code
@pytest.mark.parametrize("kv_layout", ["LBHNC", "BLHNC", "LBNHC"])
@pytest.mark.parametrize("model", list(vllm_caches.MODELS))
def test_the_copy_makes_what_vllms_code_makes(model, kv_layout):
    """The GPU hosts build caches with copy_of_vllm (their vLLM lacks what its engine
    config imports): the same tensors, strides, offsets, refs and bytes as vLLM's code."""
    made = {b: vllm_caches.canonical_caches(torch, model, kv_layout, 40, "cpu", seed=9, builder=b)
            for b in ("vllm", "copy")}
    (theirs, their_backing, _), (ours, our_backing, _) = made["vllm"], made["copy"]
    assert [b.nbytes for b in our_backing] == [b.nbytes for b in their_backing]
    assert all(torch.equal(a, b) for a, b in zip(our_backing, their_backing))

    def shape(caches, backing):
        start = backing[0].untyped_storage().data_ptr()
        return ([(tuple(t.tensor.shape), t.tensor.stride(), t.tensor.data_ptr() - start, t.page_size_bytes)
                 for t in caches.tensors],
                [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in caches.group_data_refs])

    assert shape(ours, our_backing) == shape(theirs, their_backing)


def test_block_pool_ids_are_distinct_in_range_and_come_in_runs():
    rng = np.random.default_rng(0)
    jobs = vllm_caches.pool_jobs(0, 4096, 2048, 64, 12, groups=2)
    for gpu, cpu in jobs:
        assert len(gpu) == 128 and len(set(gpu.tolist())) == 128 and gpu.min() >= 1 and gpu.max() < 4096
        assert len(cpu) == 128 and len(set(cpu.tolist())) == 128 and cpu.min() >= 0 and cpu.max() < 2048
    with pytest.raises(ValueError, match=r"blocks_per_job: 40 a group x 2 groups must be in \[1, 48\]"):
        vllm_caches.pool_jobs(0, 96, 96, 40, 1, groups=2)
    # A running pool hands out runs of neighbouring ids (descending: it reuses the last
    # freed, tail first), where uniform ids have almost none.
    runs = vllm_caches.run_lengths(np.concatenate([g for g, _ in jobs]))
    assert runs["gpu"] > 2 * vllm_caches.run_lengths(rng.permutation(4096)[:1536])["gpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_layout", vllm_caches.KV_LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_stores_and_loads_with_pool_ids_move_vllms_bytes(model, kv_layout, device):
    caches, backing, _ = vllm_caches.canonical_caches(torch, model, kv_layout, BLOCKS, device, seed=5)
    groups = len(caches.group_data_refs)
    worker = KVOffloadWorker(caches, 1, BLOCKS)
    try:
        if device == "cuda" and kv_layout in ("LBHNC", "LBNHC"):
            # Rows of one allocation go by 2D copies, by default, below ROWS_BELOW_PAGE_BYTES
            # a page; where the driver refuses them (expandable segments), the ring, saying why.
            reasons = worker.handler.method_reasons
            pages = page_paths.layout_pages(worker.handler.layout)
            small = max(p for group in pages for p in group) < page_paths.ROWS_BELOW_PAGE_BYTES
            if not small:  # a copy a page, as on separate allocations
                assert worker.handler.methods == {"store": "pages_dma", "load": "pages_dma"}
                assert "2D copies" not in reasons["store"], reasons
            elif "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
                assert "not one allocation" in reasons["store"], reasons
            else:
                assert worker.handler.methods == {"store": "pages_dma", "load": "pages_dma"}
                assert "DMA by 2D copies" in reasons["store"] and worker.handler.cpu_layout == "chunk_major", reasons
        rng = np.random.default_rng(11)
        jobs = vllm_caches.pool_jobs(11, BLOCKS, BLOCKS, 8, 4, groups=groups, warm_requests=20)
        saved = [b.clone() for b in backing]
        job_id = 0
        for gpu, cpu in jobs:
            spec = GPULoadStoreSpec(gpu.tolist(), [8] * groups, [0] * groups)
            assert worker.submit_store(job_id, spec, CPULoadStoreSpec(cpu.tolist()))
            finish(worker, job_id)
            for b in backing:  # poison the whole cache, then load every block back
                b.fill_(-91)
            assert worker.submit_load(job_id + 1, CPULoadStoreSpec(cpu.tolist()), spec)
            finish(worker, job_id + 1)
            check(caches, saved, backing, gpu, groups)
            untouched = poisoned_bytes(caches, gpu, groups)
            assert all(bool((b == -91).all()) for b in untouched), "a load wrote outside its blocks"
            for b, s in zip(backing, saved):
                b.copy_(s)
            job_id += 2
    finally:
        worker.shutdown()


def finish(worker, job_id):
    import time
    started = time.perf_counter()
    while True:
        done = [r for r in worker.get_finished() if r.job_id == job_id]
        if done:
            assert done[0].success, done
            return
        assert time.perf_counter() - started < 60, f"job {job_id} never finished"
        time.sleep(0.001)


def poisoned_bytes(caches, gpu, groups):
    """Every page of every group outside the job's blocks (which a load must not write)."""
    per_group = np.split(gpu, groups)
    out = []
    for g, refs in enumerate(caches.group_data_refs):
        for ref in refs:
            view = caches.tensors[ref.tensor_idx].tensor
            # Blocks another group of the job loads share these bytes (groups overlay).
            others = np.setdiff1d(np.arange(view.shape[0]), np.concatenate(per_group))
            out.append(view[torch.as_tensor(others, device=view.device), :ref.page_size_bytes])
    return out


def check(caches, saved, backing, gpu, groups):
    """Each group's blocks hold their bytes again, page by page."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    per_group = np.split(gpu, groups)
    for g, refs in enumerate(caches.group_data_refs):
        ids = torch.as_tensor(per_group[g], device=backing[0].device)
        for ref in refs:
            view = caches.tensors[ref.tensor_idx].tensor
            # The same pages of the saved copy: a view of it at the same offsets.
            base = view.data_ptr() - view.untyped_storage().data_ptr()
            owner = next(i for i, b in enumerate(backing)
                         if b.untyped_storage().data_ptr() == view.untyped_storage().data_ptr())
            then = torch.tensor([], dtype=torch.int8, device=view.device).set_(
                saved[owner].untyped_storage(), base + saved[owner].storage_offset(), view.shape, view.stride())
            page = ref.page_size_bytes
            assert torch.equal(view[ids, :page], then[ids, :page]), f"group {g} tensor {ref.tensor_idx}"
