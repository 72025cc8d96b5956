"""kvoffload.vllm.KVOffloadWorker driven as vLLM's connector drives an OffloadingWorker,
on CPU tensors (the handler's host lanes), with vLLM's own spec classes."""

import threading
import time

import numpy as np
import pytest
import torch

from vllm_cache import CASES, VllmCache, finish, job, round_trip
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches,
                                     CanonicalKVCacheTensor, GPULoadStoreSpec)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

import kvoffload.jobs.methods
from kvoffload.vllm import KVOffloadWorker

@pytest.mark.parametrize("case", CASES.keys())
@pytest.mark.parametrize("seed", [0, 1])
def test_store_then_load_in_two_jobs_round_trips(case, seed):
    rng = np.random.default_rng(seed)
    rows, refs, n, bpc = CASES[case]
    round_trip(rng, VllmCache(rng, rows, refs, num_blocks=64), bpc, num_chunks=40, n=n)


def test_a_job_naming_one_shared_block_in_two_groups_is_refused():
    rng = np.random.default_rng(2)
    rows, refs, _, bpc = CASES["hybrid: groups share tensors, pages differ in a padded row"]
    worker = KVOffloadWorker(VllmCache(rng, rows, refs, num_blocks=16).kv_caches, bpc, 8)
    gpu, cpu = job([np.array([3, 4]), np.array([5, 3])], [0, 0], [np.array([0]), np.array([1])], bpc)
    with pytest.raises(ValueError, match=r"submit_store\(job_id=1\): group 1: src_spec\.block_ids\[3\] = 3 "
                                         r"is also used by group 0"):
        worker.submit_store(1, gpu, cpu)
    gpu, cpu = job([np.array([3, 4]), np.array([5, 6])], [0, 0], [np.array([2]), np.array([2])], bpc)
    with pytest.raises(ValueError, match=r"submit_load\(job_id=2\): group 1: src_spec\.block_ids\[1\] = 2 "
                                         r"is also used by group 0"):
        worker.submit_load(2, cpu, gpu)
    assert worker.get_finished() == []
    worker.shutdown()


def caches(tensors, refs):
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
                             [[CanonicalKVCacheRef(i, p) for i, p in g] for g in refs])


@pytest.mark.parametrize("kv_caches, message", [
    (lambda: caches([torch.zeros(8, 64, dtype=torch.int8)], [[(1, 64)]]),
     r"kv_caches\.group_data_refs\[0\]\[0\]\.tensor_idx: 1 is out of range \[0, 1\)"),
    (lambda: caches([torch.zeros(8, 64, dtype=torch.int8)], [[(0, 65)]]),
     r"kv_caches\.group_data_refs\[0\]\[0\]\.page_size_bytes: 65 is not in \(0, 64\]"),
    (lambda: caches([torch.zeros(8, 64, dtype=torch.int8), torch.zeros(8, 64, dtype=torch.int8, device="meta")],
                    [[(0, 64), (1, 64)]]),
     r"kv_caches\.tensors: on more than one device \(\['cpu', 'meta'\]\)"),
    (lambda: CanonicalKVCaches([CanonicalKVCacheTensor(torch.zeros(8, 100, dtype=torch.int16)[:, :50], 100)],
                               [[CanonicalKVCacheRef(0, 100)]]),
     r"kv_caches\.tensors\[0\]: \(8, 50\) torch\.int16 tensor is not contiguous blocks of page_size_bytes=100"),
])
def test_caches_that_do_not_fit_are_refused_naming_the_field(kv_caches, message):
    with pytest.raises(ValueError, match=message):
        KVOffloadWorker(kv_caches(), 2, 4)


def test_bad_jobs_are_refused_naming_the_vllm_field():
    rng = np.random.default_rng(3)
    worker = KVOffloadWorker(VllmCache(rng, [64], [[(0, 64)]], num_blocks=8).kv_caches, 2, 4)
    with pytest.raises(ValueError, match=r"submit_store\(job_id=1\): group 0: dst_spec\.block_ids\[0\] = 4 "
                                         r"is out of range \[0, 4\)"):
        worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([4]))
    with pytest.raises(ValueError, match=r"submit_load\(job_id=2\): group 0: dst_spec\.block_ids\[1\] = 8"):
        worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([0, 8], [2], [0]))
    with pytest.raises(ValueError, match=r"submit_store\(job_id=3\): src_spec\.group_sizes: has 2 groups"):
        worker.submit_store(3, GPULoadStoreSpec([0], [1, 0], [0, 0]), CPULoadStoreSpec([0]))
    with pytest.raises(TypeError, match=r"submit_load\(job_id=4\): src_spec: expected a CPULoadStoreSpec"):
        worker.submit_load(4, GPULoadStoreSpec([0], [1], [0]), GPULoadStoreSpec([0], [1], [0]))
    assert worker.submit_store(5, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
    with pytest.raises(ValueError, match=r"submit_store\(job_id=5\): job_id: 5 is already in use"):
        worker.submit_store(5, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([1]))
    worker.wait({5})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(5, True)]
    worker.shutdown()


class Gate:
    """Replaces the handler's host copy: a copy whose destination is ``blocked`` waits until
    ``release()``; ``fail`` makes copies to it raise."""

    def __init__(self, monkeypatch):
        self.blocked, self.fail, self._open = set(), set(), threading.Event()
        real = kvoffload.jobs.methods.host_copy

        def copy(src, dst, sizes, **kwargs):
            if set(np.asarray(dst).tolist()) & self.fail:
                raise RuntimeError("injected copy failure")
            if set(np.asarray(dst).tolist()) & self.blocked:
                assert self._open.wait(60)
            return real(src, dst, sizes, **kwargs)

        monkeypatch.setattr(kvoffload.jobs.methods, "host_copy", copy)

    def release(self):
        self._open.set()


def test_submission_never_blocks_and_expedited_loads_pass_queued_loads(monkeypatch):
    rng = np.random.default_rng(4)
    cache = VllmCache(rng, [64], [[(0, 64)]], num_blocks=8)
    worker = KVOffloadWorker(cache.kv_caches, 1, 8)
    gate = Gate(monkeypatch)
    gate.blocked.add(cache.tensors[0][1].data_ptr())
    snapshot = cache.snapshot()
    started = time.perf_counter()
    assert worker.submit_store(1, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0, 1]))
    finish(worker, {1}, started)
    assert worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([1], [1], [0]))  # blocked
    assert worker.submit_load(3, CPULoadStoreSpec([1]), GPULoadStoreSpec([4], [1], [0]))  # queued behind 2
    started = time.perf_counter()
    assert worker.submit_load(4, CPULoadStoreSpec([1]), GPULoadStoreSpec([5], [1], [0]), expedited=True)
    worker.wait({4})
    assert [r.job_id for r in worker.get_finished()] == [4]
    cache.assert_blocks(snapshot, 0, [2], [5])
    gate.release()
    finish(worker, {2, 3}, started)
    cache.assert_blocks(snapshot, 0, [1, 2], [1, 4])
    worker.shutdown()


def test_a_failed_job_is_reported_not_raised_and_its_chunks_fail_loads(monkeypatch):
    rng = np.random.default_rng(5)
    pages = 64
    cache = VllmCache(rng, [pages], [[(0, pages)]], num_blocks=8)
    worker = KVOffloadWorker(cache.kv_caches, 1, 8)
    gate = Gate(monkeypatch)
    gate.fail.add(worker.handler.pool.base + 3 * pages)  # chunk 3 of the pool
    assert worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([3]))
    worker.wait({1})
    (failed,) = worker.get_finished()
    assert (failed.job_id, failed.success) == (1, False)
    assert not worker.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([4], [1], [0]))
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, False)]
    started = time.perf_counter()
    assert worker.submit_store(3, GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([2]))
    assert finish(worker, {3}, started)[3].transfer_size == pages
    worker.shutdown()


def with_fields(spec, **fields):
    """A vLLM spec made valid, then given fields its constructor would have refused."""
    for name, value in fields.items():
        setattr(spec, name, value)
    return spec


def test_malformed_specs_are_refused_naming_the_job_and_the_vllm_field():
    rng = np.random.default_rng(8)
    cache = VllmCache(rng, [64], [[(0, 64)]], num_blocks=8)
    worker = KVOffloadWorker(cache.kv_caches, 2, 4)
    snapshot = cache.snapshot()
    gpu = lambda **f: with_fields(GPULoadStoreSpec([0], [1], [0]), **f)
    cpu = lambda **f: with_fields(CPULoadStoreSpec([0]), **f)
    cases = [
        (TypeError, r"submit_store\(job_id=1\): src_spec\.group_sizes: expected a sequence of ints, got NoneType",
         lambda: worker.submit_store(1, gpu(group_sizes=None), cpu())),
        (TypeError, r"submit_load\(job_id=2\): dst_spec\.block_indices: expected a sequence of ints, got int",
         lambda: worker.submit_load(2, cpu(), gpu(block_indices=0))),
        (TypeError, r"submit_store\(job_id=3\): dst_spec\.block_ids: expected a 1-D int64 array or a sequence",
         lambda: worker.submit_store(3, gpu(), cpu(block_ids=None))),
        (ValueError, r"submit_load\(job_id=4\): src_spec\.block_ids: expected a 1-D array, got 2-D",
         lambda: worker.submit_load(4, cpu(block_ids=[[0]]), gpu())),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    assert worker.get_finished() == []
    for t, s in zip(cache.tensors, snapshot):
        assert torch.equal(t, s)
    worker.shutdown()


@pytest.mark.parametrize("kv_caches, error, message", [
    (lambda: caches([], []), ValueError, r"kv_caches: no tensors to offload \(0 tensors, 0 groups"),
    (lambda: caches([torch.zeros(8, 64, dtype=torch.int8)], [[], []]), ValueError,
     r"kv_caches: no tensors to offload \(1 tensors, 2 groups, none referencing a tensor\)"),
    (lambda: caches([torch.zeros(8, 64, dtype=torch.int8)] * 2, [[(True, 64)]]), TypeError,
     r"kv_caches\.group_data_refs\[0\]\[0\]\.tensor_idx: expected an int, got bool"),
    (lambda: caches([torch.zeros(8, 64, dtype=torch.int8)], [[(0, 64)], [(0, True)]]), TypeError,
     r"kv_caches\.group_data_refs\[1\]\[0\]\.page_size_bytes: expected an int, got bool"),
    (lambda: caches([torch.zeros(8, 64, dtype=torch.int8)], [[(None, 64)]]), TypeError,
     r"kv_caches\.group_data_refs\[0\]\[0\]\.tensor_idx: expected an int, got NoneType"),
])
def test_caches_of_no_tensors_or_bool_fields_are_refused_naming_the_field(kv_caches, error, message):
    with pytest.raises(error, match=message):
        KVOffloadWorker(kv_caches(), 2, 4)


def test_wait_takes_any_collection_of_ids_and_waits_for_each(monkeypatch):
    rng = np.random.default_rng(6)
    cache = VllmCache(rng, [64], [[(0, 64)]], num_blocks=8)
    worker = KVOffloadWorker(cache.kv_caches, 1, 8)
    gate = Gate(monkeypatch)
    gate.blocked.add(cache.tensors[0][3].data_ptr())
    for job_id, ids in ((7, frozenset({7})), (8, [8]), (9, (9,))):
        gate._open.clear()
        assert worker.submit_load(job_id, CPULoadStoreSpec([0]), GPULoadStoreSpec([3], [1], [0]))  # held
        waiting = threading.Thread(target=worker.wait, args=(ids,))
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive(), f"wait({ids!r}) returned while its job was held"
        gate.release()
        waiting.join(30)
        assert not waiting.is_alive()
        assert [r.job_id for r in worker.get_finished()] == [job_id]
    worker.shutdown()
