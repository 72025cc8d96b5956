"""kvoffload.jobs.handler on a GPU: vLLM's worker cases, the compute-stream and store/load
races, failures, a soak, and a registered host buffer."""

import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload import _C
from kvoffload.copy import methods as copy_methods
from kvoffload.jobs.handler import OffloadHandler
from kvoffload.pages.planner import CPUSpec, GPUSpec, chunks_used
from kv_model import (a_failure_mid_job_fails_that_job_only, copy_half_then_fail, make_handler,
                      multi_group_with_an_empty_and_an_unaligned_group, pool_views, soak,
                      store_then_load_skipping_first_blocks)
from scale import scaled
from calibrated import quick_calibration  # noqa: F401 - autouse

SLEEP_CYCLES = 200_000  # keeps the compute stream busy for ~0.1 ms


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


@pytest.mark.parametrize("cpu_layout", ["chunk_major", "per_tensor"])
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("bpc", [1, 3])
@pytest.mark.parametrize("method", ["pages", "pages_staged", "pages_dma", "pages_kernel", "auto", "batch",
                                    "per_copy", "kernel",
                                    "staged", copy_methods.Kernel(max_ctas=2),
                                    copy_methods.Staged(slot_bytes=1 << 20, slots=3, max_ctas=2)], ids=str)
def test_store_and_load_skipping_the_first_blocks_of_a_chunk(cpu_layout, page, bpc, method):
    store_then_load_skipping_first_blocks("cuda", cpu_layout, page, bpc, method=method)


@pytest.mark.parametrize("page, method, cpu_layout", [
    (64 << 10, "pages", "per_tensor"), (4 << 10, "pages", "chunk_major"), (64 << 10, "pages_dma", "per_tensor"),
    (64 << 10, "pages_staged", "chunk_major"), (64 << 10, "batch", "chunk_major")])
@pytest.mark.parametrize("bpc", [1, 3])
def test_the_default_pool_is_per_tensor_where_pages_go_by_dma(page, method, cpu_layout, bpc):
    handler = store_then_load_skipping_first_blocks("cuda", None, page, bpc, method=method)
    assert handler.cpu_layout == cpu_layout
    tensors = handler.layout.groups[0].tensors  # four tensors
    assert [t.cpu_stride for t in tensors] == [bpc * page * (1 if cpu_layout == "per_tensor" else 4)] * 4


def test_a_shared_or_background_pool_stays_chunk_major():
    cache = [[torch.zeros((8, 64 << 10), dtype=torch.uint8, device="cuda") for _ in range(2)]]
    for options in (kv.PoolOptions(background=True), kv.PoolOptions(shm_name=f"kvoffload-test-{uuid.uuid4().hex}")):
        handler = OffloadHandler(cache, 8, 1, host_pool=options)
        try:
            assert handler.methods == {"store": "pages_dma", "load": "pages_dma"}
            assert handler.cpu_layout == "chunk_major"
            assert [t.cpu_stride for t in handler.layout.groups[0].tensors] == [2 * (64 << 10)] * 2
        finally:
            handler.shutdown()
    own = OffloadHandler(cache, 8, 1, host_buffer=torch.empty(2 * 8 * (64 << 10), dtype=torch.uint8))
    try:
        assert own.cpu_layout == "chunk_major"
        assert [t.cpu_stride for t in own.layout.groups[0].tensors] == [2 * (64 << 10)] * 2
    finally:
        own.shutdown()


@pytest.mark.parametrize("expedite", [False, True])
def test_multi_group_with_an_empty_and_an_unaligned_group(expedite):
    multi_group_with_an_empty_and_an_unaligned_group("cuda", "chunk_major", expedite)


@pytest.mark.parametrize("method", ["pages_staged", "pages_dma"])
def test_a_store_sees_what_the_compute_stream_wrote_just_before(method):
    handler, _ = make_handler(np.random.default_rng(1), [4096], [2], num_blocks=64, num_chunks=64,
                              bpc=1, cpu_layout="chunk_major", device="cuda", method=method)
    views = pool_views(handler, handler.pool.tensor.numpy())
    rng = np.random.default_rng(2)
    trials = scaled(1000)
    for trial in range(trials):
        ids = rng.permutation(64)[:4]
        chunks = rng.permutation(64)[:4]
        value = trial % 251 + 1
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in handler.gpu_tensors[0]:
            t[torch.from_numpy(ids).cuda()] = value
        assert handler.store(trial, GPUSpec(ids, [4], [0]), CPUSpec(chunks))
        handler.wait([trial])
        for t in range(2):
            assert (views[0][t][chunks] == value).all(), f"trial {trial}: the store read stale blocks"
    assert len(handler.get_finished()) == trials
    handler.shutdown()


@pytest.mark.parametrize("method", ["pages_staged", "pages_dma"])
def test_a_load_right_after_a_store_of_the_same_chunks_reads_the_stored_bytes(method):
    handler, _ = make_handler(np.random.default_rng(3), [4096], [2], num_blocks=64, num_chunks=64,
                              bpc=2, cpu_layout="chunk_major", device="cuda", method=method)
    rng = np.random.default_rng(4)
    trials = scaled(1000)
    for trial in range(trials):
        stored, loaded = np.split(rng.permutation(64)[:8], 2)
        chunks = rng.permutation(64)[:2]
        value = trial % 251 + 1
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in handler.gpu_tensors[0]:
            t[torch.from_numpy(stored).cuda()] = value
        assert handler.store(("s", trial), GPUSpec(stored, [4], [0]), CPUSpec(chunks))
        assert handler.load(("l", trial), CPUSpec(chunks), GPUSpec(loaded, [4], [0]))
        handler.wait([("l", trial)])
        for t in handler.gpu_tensors[0]:
            got = t[torch.from_numpy(loaded).cuda()]
            assert (got == value).all(), f"trial {trial}: the load did not see the store"
    handler.wait([("s", trials - 1)])
    results = handler.get_finished()
    assert len(results) == 2 * trials and all(r.success for r in results)
    handler.shutdown()


class OrderSpy:
    """Stands in for a handler's page table: records the src_order of every page copy
    that names one (the handler's loads)."""

    def __init__(self, pages):
        self._pages, self.orders = pages, []

    def copy_job(self, job, **kwargs):
        if "src_order" in kwargs:
            self.orders.append(kwargs["src_order"])
        return self._pages.copy_job(job, **kwargs)


def test_a_dma_load_reads_the_pool_out_of_stream_order_only_when_no_store_it_reads_is_in_flight():
    handler, _ = make_handler(np.random.default_rng(7), [4096], [2], num_blocks=64, num_chunks=64,
                              bpc=1, cpu_layout="chunk_major", device="cuda", method="pages_dma")
    stored, loaded, elsewhere = np.split(np.random.default_rng(8).permutation(64)[:12], 3)
    # Once first, so that nothing made on first use (which may wait for the GPU) runs below.
    assert handler.store("warm", GPUSpec(stored, [4], [0]), CPUSpec(list(range(20, 24))))
    assert handler.load("warm load", CPUSpec(list(range(20, 24))), GPUSpec(loaded, [4], [0]))
    handler.wait(["warm", "warm load"])
    handler._jobs._table = spy = OrderSpy(handler._jobs._table)
    for t in handler.gpu_tensors[0]:
        t[torch.from_numpy(stored).cuda()] = 7
        t[torch.from_numpy(loaded).cuda()] = 0
    torch.cuda._sleep(1000 * SLEEP_CYCLES)  # the store waits for this, so it is in flight below
    assert handler.store("store", GPUSpec(stored, [4], [0]), CPUSpec(list(range(4))))
    assert handler.load("behind", CPUSpec(list(range(4))), GPUSpec(loaded, [4], [0]))
    assert handler.load("beside", CPUSpec(list(range(8, 12))), GPUSpec(elsewhere, [4], [0]))
    deadline = time.monotonic() + 10
    while len(spy.orders) < 2 and time.monotonic() < deadline:
        time.sleep(1e-4)
    assert not torch.cuda.current_stream().query(), "the sleep ended before the loads were enqueued"
    handler.wait(["store", "behind", "beside"])
    for t in handler.gpu_tensors[0]:
        assert (t[torch.from_numpy(loaded).cuda()] == 7).all(), "the load behind the store missed it"
        t[torch.from_numpy(loaded).cuda()] = 0
    assert handler.load("after", CPUSpec(list(range(4))), GPUSpec(loaded, [4], [0]))
    handler.wait(["after"])
    order = _C.SrcAccessOrder
    assert spy.orders == [order.STREAM, order.ANY, order.ANY]  # behind, beside, after
    for t in handler.gpu_tensors[0]:
        assert (t[torch.from_numpy(loaded).cuda()] == 7).all()
    assert all(r.success for r in handler.get_finished())
    handler.shutdown()


@pytest.mark.parametrize("method", ["pages", "pages_dma", "pages_kernel", "auto", "kernel", "staged"])
def test_a_soak_of_mixed_jobs_loses_nothing(method):
    rng = np.random.default_rng(5)
    handler, model = make_handler(rng, [2048, 1024], [4, 2], num_blocks=96, num_chunks=80, bpc=2,
                                  cpu_layout="chunk_major", device="cuda", method=method)
    allocated = soak(handler, model, rng, jobs=scaled(5000, 1000), max_in_flight=64)
    assert allocated[-1] <= 66  # bounded by the jobs in flight, not by the 5000 jobs run
    handler.shutdown()


@pytest.mark.parametrize("method", ["batch", "kernel", "staged"])
def test_a_cuda_failure_mid_job_fails_that_job_only(monkeypatch, method):
    handler, model = make_handler(np.random.default_rng(6), [1024], [2], num_blocks=16, num_chunks=8,
                                  bpc=2, cpu_layout="chunk_major", device="cuda", method=method)
    # The handler copies with its method object: the failing copy stands in for it.
    failing, arm = copy_half_then_fail(
        handler._jobs._method, kv.CudaError("cuMemcpyBatchAsync: CUDA_ERROR_LAUNCH_FAILED: injected"))
    monkeypatch.setattr(handler._jobs, "_method", failing)
    a_failure_mid_job_fails_that_job_only(handler, model, arm)
    handler.shutdown()


class HalfThenFail:
    """Stands in for a handler's page table: once armed, its next copy moves the first
    half of a one-group job's blocks and raises CudaError."""

    def __init__(self, pages, bpc):
        self._pages, self._bpc, self._armed = pages, bpc, False

    def arm(self):
        self._armed = True

    @property
    def copy_job(self):
        """The handler takes this when it submits a job: the job submitted after arm()
        gets the failing copy, whenever its copy runs."""
        if not self._armed:
            return self._pages.copy_job
        self._armed = False
        return self._half_then_fail

    def _half_then_fail(self, job, **kwargs):
        block_ids, chunk_ids, sizes, firsts = job.ids()
        half, first = int(sizes[0]) // 2, int(firsts[0])
        self._pages.copy(block_ids[:half], chunk_ids[: chunks_used(half, first, self._bpc)],
                         [half], [first], **kwargs)
        raise kv.CudaError("page copy kernel launch: cudaErrorLaunchFailure: injected")


@pytest.mark.parametrize("method", ["pages_staged", "pages_dma", "pages_kernel"])
def test_a_cuda_failure_mid_page_job_fails_that_job_only(method):
    handler, model = make_handler(np.random.default_rng(6), [1024], [2], num_blocks=16, num_chunks=8,
                                  bpc=2, cpu_layout="chunk_major", device="cuda", method=method)
    handler._jobs._table = failing = HalfThenFail(handler._jobs._table, 2)
    a_failure_mid_job_fails_that_job_only(handler, model, failing.arm)
    handler.shutdown()


def test_a_registered_host_buffer_is_page_locked_and_released():
    gpu = [[torch.randint(0, 255, (16, 2048), dtype=torch.uint8, device="cuda") for _ in range(2)]]
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    assert not _C.is_pinned_host(buffer.data_ptr())
    handler = OffloadHandler(gpu, 8, 2, host_buffer=buffer)
    assert _C.is_pinned_host(buffer.data_ptr()) and handler.pool.base == buffer.data_ptr()
    assert handler.store(0, GPUSpec([3, 5], [2], [0]), CPUSpec([4]))
    handler.wait([0])
    assert handler.get_finished()[0].success
    view = pool_views(handler, buffer.numpy())
    for t in range(2):
        np.testing.assert_array_equal(view[0][t][4], gpu[0][t][[3, 5]].cpu().numpy())
    handler.shutdown()
    assert not _C.is_pinned_host(buffer.data_ptr())


# Run in a fresh process: kernels are loaded and staging rings made once per process, so
# those of another test would hide a wait.
_FIRST_COPIES = """
import os, sys
import numpy as np, torch
sys.path.insert(0, os.getcwd())
from kv_model import check, make_handler
from kvoffload.pages.planner import CPUSpec, GPUSpec

rng = np.random.default_rng(int(sys.argv[1]))
handler, model = make_handler(rng, [1024], [2], num_blocks=16, num_chunks=4, bpc=4,
                              cpu_layout="chunk_major", device="cuda", expedited_loads=True)
torch.cuda.synchronize()
held = torch.cuda.Stream()
with torch.cuda.stream(held):
    torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU cycles
stored, loaded = rng.permutation(16)[:8], rng.permutation(16)[:4]
assert handler.store("store", GPUSpec(stored, [8], [0]), CPUSpec([0, 1]))
handler.wait(["store"])
store_done_while_held = not held.query()
assert handler.load("expedited", CPUSpec([1]), GPUSpec(loaded, [4], [0]), expedite=True)
handler.wait(["expedited"])
print("done while held:", store_done_while_held and not held.query())
for result in handler.get_finished():
    assert result.success, result.error
model.store(stored, [8], [0], [0, 1])
model.load(loaded, [4], [0], [1])
torch.cuda.synchronize()
check(handler, model)
handler.shutdown()
"""


def test_a_processs_first_copies_do_not_wait_for_the_device():
    # The process's first page copies, and the expedited load's new ring, while another
    # stream spins: the handler loaded its kernels when it was made (load_kernels).
    here = os.path.dirname(os.path.abspath(__file__))
    # Hardware queues enough that the spin's stream shares none with the handler's.
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="32")
    run = subprocess.run([sys.executable, "-c", _FIRST_COPIES, "13"], cwd=here, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done while held: True" in run.stdout, run.stdout + run.stderr[-3000:]
