"""kvoffload.handler on a machine without a GPU: jobs on host threads, the same API
and the same ordering rules as on a GPU."""

import numpy as np
import pytest
import torch

import kvoffload.handler
from kvoffload.handler import OffloadHandler
from kvoffload.host_pool import cpu_tensor_layouts, pool_bytes
from kvoffload.planner import CPUSpec, GPUSpec
from kv_model import (a_failure_mid_job_fails_that_job_only, check, copy_half_then_fail,
                      make_handler, multi_group_with_an_empty_and_an_unaligned_group, soak,
                      store_then_load_skipping_first_blocks)

LAYOUTS = ["chunk_major", "per_tensor"]


@pytest.mark.parametrize("cpu_layout", LAYOUTS)
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("bpc", [1, 3])
def test_store_and_load_skipping_the_first_blocks_of_a_chunk(cpu_layout, page, bpc):
    store_then_load_skipping_first_blocks("cpu", cpu_layout, page, bpc)


@pytest.mark.parametrize("cpu_layout", LAYOUTS)
def test_multi_group_with_an_empty_and_an_unaligned_group(cpu_layout):
    multi_group_with_an_empty_and_an_unaligned_group("cpu", cpu_layout)


def test_pool_layouts_place_chunks_as_documented():
    pages, chunks, bpc = [[100, 300], [64]], [5, 3], 2
    major = cpu_tensor_layouts(pages, chunks, bpc, base=1 << 20, cpu_layout="chunk_major")
    assert major[0] == [(1 << 20, 800), ((1 << 20) + 200, 800)]
    assert major[1] == [((1 << 20) + 4096, 128)]
    per_tensor = cpu_tensor_layouts(pages, chunks, bpc, base=0, cpu_layout="per_tensor")
    assert per_tensor[0] == [(0, 200), (1000, 600)] and per_tensor[1] == [(4096, 128)]
    assert pool_bytes(pages, chunks, bpc) == 4096 + 4096
    with pytest.raises(ValueError, match=r"cpu_layout: expected one of"):
        cpu_tensor_layouts(pages, chunks, bpc, 0, "blocked")


def test_a_load_right_after_a_store_of_the_same_chunks_reads_the_stored_bytes():
    rng = np.random.default_rng(2)
    handler, model = make_handler(rng, [64 << 10], [8], num_blocks=64, num_chunks=40, bpc=1,
                                  cpu_layout="chunk_major")
    for trial in range(20):
        chunks = rng.permutation(40)[:32]
        stored, loaded = rng.permutation(64)[:32], rng.permutation(64)[:32]
        assert handler.transfer_async(("s", trial), GPUSpec(stored, [32], [0]), CPUSpec(chunks))
        assert handler.transfer_async(("l", trial), CPUSpec(chunks), GPUSpec(loaded, [32], [0]))
        model.store(stored, [32], [0], chunks)
        model.load(loaded, [32], [0], chunks)
        handler.wait([("s", trial), ("l", trial)])
        check(handler, model)
    assert all(r.success for r in handler.get_finished())
    handler.shutdown()


def test_a_soak_of_mixed_jobs_loses_nothing_and_allocates_nothing_new():
    rng = np.random.default_rng(3)
    handler, model = make_handler(rng, [256, 128], [2, 3], num_blocks=48, num_chunks=40, bpc=2,
                                  cpu_layout="chunk_major")
    allocated = soak(handler, model, rng, jobs=3000, max_in_flight=32)
    assert allocated[-1] <= 34  # bounded by the jobs in flight, not by the 3000 jobs run
    handler.shutdown()


def small_handler(**kwargs):
    rng = np.random.default_rng(0)
    return make_handler(rng, [128], [2], num_blocks=8, num_chunks=4, bpc=2, cpu_layout="chunk_major",
                        **kwargs)


def test_bad_jobs_raise_before_anything_is_submitted():
    handler, model = small_handler()
    store = (GPUSpec([0, 1], [2], [0]), CPUSpec([0]))
    assert handler.transfer_async("a", *store)
    with pytest.raises(ValueError, match=r"job_id: 'a' is already in use"):
        handler.transfer_async("a", *store)
    handler.wait(["a"])
    with pytest.raises(ValueError, match=r"job_id: 'a' is already in use"):
        handler.transfer_async("a", *store)  # finished, not yet collected
    handler.get_finished()
    model.store([0, 1], [2], [0], [0])
    before = handler.pool.tensor.clone()
    cases = [
        ((GPUSpec([0, 8], [2], [0]), CPUSpec([1])), ValueError, r"group 0: block_ids\[1\] = 8 is out of range"),
        ((GPUSpec([0, 1], [2], [0]), CPUSpec([1, 2])), ValueError, r"chunk_ids: has 2 ids but the groups use 1"),
        ((GPUSpec([0, 1], [1, 1], [0, 0]), CPUSpec([1])), ValueError, r"group_sizes: has 2 groups but the layout has 1"),
        ((GPUSpec([0], [1], [0]), GPUSpec([1], [1], [0])), TypeError, r"src_spec, dst_spec: expected"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            handler.transfer_async("b", *args)
    with pytest.raises(ValueError, match=r"expedite: only for loads"):
        handler.transfer_async("b", CPUSpec([0]), GPUSpec([2, 3], [2], [0]), expedite=True)
    assert handler.get_finished() == [] and torch.equal(handler.pool.tensor, before)
    check(handler, model)
    handler.shutdown()
    for call in (lambda: handler.transfer_async("c", *store), lambda: handler.wait(["a"])):
        with pytest.raises(RuntimeError, match=r"the handler is shut down"):
            call()


def test_a_failure_mid_job_fails_that_job_only(monkeypatch):
    handler, model = make_handler(np.random.default_rng(6), [512], [2], num_blocks=16, num_chunks=8,
                                  bpc=2, cpu_layout="chunk_major")
    failing, arm = copy_half_then_fail(kvoffload.handler.host_copy, OSError("injected failure"))
    monkeypatch.setattr(kvoffload.handler, "host_copy", failing)
    a_failure_mid_job_fails_that_job_only(handler, model, arm)
    handler.shutdown()


def test_host_buffer_too_small_is_rejected():
    gpu = [[torch.zeros((8, 128), dtype=torch.uint8)]]
    with pytest.raises(ValueError, match=r"host_buffer: holds 100 bytes, the layout needs 4096"):
        OffloadHandler(gpu, 4, 2, host_buffer=torch.zeros(100, dtype=torch.uint8))


def test_gpu_tensors_on_two_devices_are_rejected():
    gpu = [[torch.zeros((8, 128), dtype=torch.uint8), torch.zeros((8, 128), dtype=torch.uint8, device="meta")]]
    with pytest.raises(ValueError, match=r"gpu_tensors: expected one device"):
        OffloadHandler(gpu, 4, 2)

