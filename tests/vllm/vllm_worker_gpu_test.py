"""kvoffload.vllm.KVOffloadWorker on a GPU, with vLLM's classes: the CPU tests' round
trips on device tensors and pinned pools, per copy method; stores that follow the compute
stream; times from CUDA events."""

import time

import numpy as np
import pytest
import torch

from scale import scaled
from vllm_cache import CASES, VllmCache, finish, round_trip
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvoffload import _C
from kvoffload.vllm import KVOffloadWorker
from calibrated import quick_calibration  # noqa: F401 - autouse

SLEEP_CYCLES = 50_000_000  # about 25 ms of GPU time queued before each write


@pytest.mark.parametrize("method", ["pages", "pages_staged", "pages_dma", "auto", "batch", "kernel"])
@pytest.mark.parametrize("case", CASES.keys())
def test_store_then_load_in_two_jobs_round_trips(case, method):
    rng = np.random.default_rng(0)
    rows, refs, n, bpc = CASES[case]
    pinned = []
    round_trip(rng, VllmCache(rng, rows, refs, num_blocks=256, device="cuda"), bpc,
               num_chunks=160, n=[4 * k for k in n], method=method,
               before_shutdown=lambda w: pinned.append(_C.is_pinned_host(w.handler.pool.base)))
    assert pinned == [True], "the worker's pool is not pinned"


def test_a_store_sees_what_the_compute_stream_wrote_and_times_are_gpu_times():
    rng = np.random.default_rng(1)
    cache = VllmCache(rng, [4096, 4096], [[(0, 4096), (1, 4096)]], num_blocks=64, device="cuda")
    worker = KVOffloadWorker(cache.kv_caches, 1, 64, method="batch")
    for trial in range(scaled(200)):
        ids, chunks = rng.permutation(64)[:4], rng.permutation(64)[:4]
        value = trial % 127 + 1
        # Nothing from host memory after the sleep: such a copy would wait for it.
        gpu_ids = torch.from_numpy(ids).cuda()
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in cache.tensors:
            t.index_fill_(0, gpu_ids, value)
        started = time.perf_counter()
        assert worker.submit_store(2 * trial, GPULoadStoreSpec(ids.tolist(), [4], [0]),
                                   CPULoadStoreSpec(chunks.tolist()))
        assert not torch.cuda.current_stream().query(), f"trial {trial}: submit_store waited for the GPU"
        # vLLM leaves blocks being stored alone until the store is reported done.
        stored = finish(worker, {2 * trial}, started)[2 * trial]
        # Well under the sleep, with room for other processes' time slices on a shared GPU.
        assert stored.transfer_time < 5e-3, "a store's time must not include the compute stream's"
        cache.poison(0, ids)
        assert worker.submit_load(2 * trial + 1, CPULoadStoreSpec(chunks.tolist()),
                                  GPULoadStoreSpec(ids.tolist(), [4], [0]), expedited=True)
        finish(worker, {2 * trial + 1}, started)
        for t in cache.tensors:
            assert (t[torch.from_numpy(ids).cuda()] == value).all(), f"trial {trial}: stale or lost bytes"
    worker.shutdown()
