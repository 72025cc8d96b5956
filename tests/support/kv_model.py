"""A sequential model of KV-cache transfers, one block at a time, and views of what a
handler's GPU tensors and CPU pool actually hold."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvoffload.jobs.handler import Direction, OffloadHandler
from kvoffload.pages.planner import CPUSpec, GPUSpec, chunks_used
from planner_reference import job_blocks

POISON = 0xA5


class KVModel:
    """gpu[g][t]: [blocks, page] bytes; cpu[g][t]: [chunks, blocks_per_chunk, page] bytes."""

    def __init__(self, gpu, num_chunks, bpc):
        self.bpc = bpc
        self.gpu = [[np.array(t, copy=True) for t in group] for group in gpu]
        self.cpu = [[np.full((num_chunks[g], bpc, t.shape[1]), POISON, dtype=np.uint8) for t in group]
                    for g, group in enumerate(gpu)]

    def _blocks(self, block_ids, group_sizes, block_indices, chunk_ids):
        """(group, block, chunk, sub-block) of every block of a transfer."""
        return job_blocks(self.bpc, block_ids, group_sizes, block_indices, chunk_ids)

    def store(self, *spec):
        for g, b, c, s in self._blocks(*spec):
            for t in range(len(self.gpu[g])):
                self.cpu[g][t][c, s] = self.gpu[g][t][b]

    def load(self, *spec):
        for g, b, c, s in self._blocks(*spec):
            for t in range(len(self.gpu[g])):
                self.gpu[g][t][b] = self.cpu[g][t][c, s]


def pool_views(handler, pool_bytes_array):
    """The handler's CPU pool as [group][tensor] arrays of [chunks, blocks_per_chunk, page]."""
    bpc = handler.layout.blocks_per_chunk
    views = []
    for group in handler.layout.groups:
        views.append([np.lib.stride_tricks.as_strided(
            pool_bytes_array[t.cpu_base - handler.pool.base:],
            shape=(group.num_cpu_chunks, bpc, t.page_bytes),
            strides=(t.cpu_stride, t.page_bytes, 1), writeable=False)
            for t in group.tensors])
    return views


def gpu_pages(tensor, page):
    """A GPU tensor as [blocks, page] bytes on the host."""
    flat = tensor.reshape(tensor.shape[0], -1).view(torch.uint8).cpu().numpy()
    return flat[:, :page]


def make_handler(rng, pages, tensors, num_blocks, num_chunks, bpc, cpu_layout, padding=0,
                 device="cpu", **kwargs):
    """A handler over random uint8 [num_blocks, page + padding] tensors, its pool poisoned,
    and the model of what both must hold."""
    gpu = [[torch.from_numpy(rng.integers(0, 256, (num_blocks, p + padding), dtype=np.uint8)).to(device)
            for _ in range(n)] for p, n in zip(pages, tensors)]
    handler = OffloadHandler(gpu, num_chunks, bpc, page_bytes=pages if padding else None,
                             cpu_layout=cpu_layout, **kwargs)
    handler.pool.tensor.fill_(POISON)
    model = KVModel([[gpu_pages(t, p) for t in group] for p, group in zip(pages, gpu)],
                    [num_chunks] * len(pages), bpc)
    return handler, model


def check(handler, model):
    """Every GPU block and every CPU sub-block equals the model's."""
    views = pool_views(handler, handler.pool.tensor.numpy())
    for g, group in enumerate(handler.gpu_tensors):
        page = handler.layout.groups[g].tensors[0].page_bytes if group else 0
        for t, tensor in enumerate(group):
            np.testing.assert_array_equal(views[g][t], model.cpu[g][t], f"cpu group {g} tensor {t}")
            np.testing.assert_array_equal(gpu_pages(tensor, page), model.gpu[g][t], f"gpu group {g} tensor {t}")


def submit_job(handler, job_id, direction, gpu, cpu, expedite=False) -> bool:
    """handler.store or handler.load, by direction ("store" or "load")."""
    if direction == "store":
        return handler.store(job_id, gpu, cpu)
    return handler.load(job_id, cpu, gpu, expedite)


def run_job(handler, model, job_id, direction, block_ids, sizes, firsts, chunk_ids, expedite=False):
    """Runs one job to completion and checks its result and every byte."""
    gpu, cpu = GPUSpec(block_ids, sizes, firsts), CPUSpec(chunk_ids)
    start = time.perf_counter()
    assert submit_job(handler, job_id, direction, gpu, cpu, expedite)
    handler.wait([job_id])
    wall = time.perf_counter() - start
    (result,) = handler.get_finished()
    getattr(model, direction)(block_ids, sizes, firsts, chunk_ids)
    check(handler, model)
    pages = sum(t.page_bytes for g, group in enumerate(handler.layout.groups)
                for t in group.tensors for _ in range(sizes[g]))
    assert (result.job_id, result.success, result.direction, result.bytes) == (
        job_id, True, Direction(direction), pages)
    assert 0 < result.seconds < wall
    return result


def store_then_load_skipping_first_blocks(device, cpu_layout, page, bpc, **handler_kwargs):
    """vLLM's worker case: store 7 blocks of 4 tensors, load them back from sub-block 1 and 2.
    Returns the handler, shut down."""
    rng = np.random.default_rng(page * bpc)
    handler, model = make_handler(rng, [page], [4], num_blocks=16, num_chunks=12, bpc=bpc,
                                  cpu_layout=cpu_layout, device=device, **handler_kwargs)
    stored = rng.permutation(16)[:7]
    chunks = rng.permutation(12)[: chunks_used(7, 0, bpc)]
    run_job(handler, model, "store", "store", stored, [7], [0], chunks)
    for first in (1, 2):
        n = 7 - first
        load_chunks = chunks[first // bpc : first // bpc + chunks_used(n, first, bpc)]
        run_job(handler, model, first, "load", rng.permutation(16)[:n], [n], [first], load_chunks)
    handler.shutdown()
    return handler


def multi_group_with_an_empty_and_an_unaligned_group(device, cpu_layout, expedite=False):
    """Three groups of different page sizes, padded blocks; group 1 is empty, group 2
    starts at sub-block 3 and ends inside its last chunk."""
    rng = np.random.default_rng(11)
    handler, model = make_handler(rng, [256, 768, 512], [2, 2, 3], num_blocks=24, num_chunks=10,
                                  bpc=4, cpu_layout=cpu_layout, padding=64, device=device,
                                  expedited_loads=expedite)
    sizes, firsts = [8, 0, 6], [0, 2, 3]
    chunks = np.concatenate([rng.permutation(10)[:2], rng.permutation(10)[:3]])
    for job, direction in enumerate(("store", "load")):
        ids = np.concatenate([rng.permutation(24)[:8], rng.permutation(24)[:6]])
        run_job(handler, model, job, direction, ids, sizes, firsts, chunks,
                expedite=expedite and direction == "load")
    handler.shutdown()


def soak(handler, model, rng, jobs, max_in_flight):
    """Random mixed jobs, at most max_in_flight at once; checks every byte and result at the
    end and returns the descriptor arrays allocated after each thousand jobs."""
    layout = handler.layout
    bpc = layout.blocks_per_chunk
    submitted, results, allocated = [], [], []
    for job in range(jobs):
        sizes = [int(rng.integers(0, 9)) for _ in layout.groups]
        firsts = [int(rng.integers(0, 2 * bpc)) for _ in layout.groups]
        ids = np.concatenate([rng.permutation(g.num_gpu_blocks)[:n] for g, n in zip(layout.groups, sizes)])
        chunks = np.concatenate([rng.permutation(g.num_cpu_chunks)[: chunks_used(n, b, bpc)]
                                 for g, n, b in zip(layout.groups, sizes, firsts)])
        direction = "store" if rng.random() < 0.5 else "load"
        gpu, cpu = GPUSpec(ids, sizes, firsts), CPUSpec(chunks)
        assert submit_job(handler, job, direction, gpu, cpu)
        getattr(model, direction)(ids, sizes, firsts, chunks)
        submitted.append(job)
        results += handler.get_finished()
        if job >= max_in_flight:
            handler.wait([job - max_in_flight])  # and every earlier job: ids are waited in order
        if job % 1000 == 999:
            allocated.append(handler.descriptor_arrays_allocated)
    handler.wait(submitted)
    results += handler.get_finished()
    check(handler, model)
    assert sorted(r.job_id for r in results) == submitted and all(r.success for r in results)
    return allocated


def a_failure_mid_job_fails_that_job_only(handler, model, arm_failure):
    """A store fails after copying half its bytes (``arm_failure()`` makes the next copy
    call do that). The failure is reported, other jobs complete, loads of the chunks it
    left partial fail without copying until a store rewrites them, and then all is well."""
    run_job(handler, model, "first", "store", [0, 1, 2, 3], [4], [0], [0, 1])
    arm_failure()
    handler.store("bad", GPUSpec([4, 5, 6, 7], [4], [0]), CPUSpec([0, 1]))
    assert handler.store("other", GPUSpec([8, 9], [2], [0]), CPUSpec([2]))
    handler.load("reader", CPUSpec([0, 1]), GPUSpec([12, 13, 14, 15], [4], [0]))
    handler.wait(["bad", "other", "reader"])
    results = {r.job_id: r for r in handler.get_finished()}
    assert not results["bad"].success and "injected" in results["bad"].error, results["bad"]
    assert not results["reader"].success, results["reader"]
    assert results["other"].success, results["other"]
    model.store([8, 9], [2], [0], [2])
    assert not handler.load("later", CPUSpec([1]), GPUSpec([14, 15], [2], [0]))
    (later,) = handler.get_finished()
    assert not later.success and "left partial by failed store 'bad'" in later.error
    check_gpu_and_chunks(handler, model, chunks=[2, 3, 4, 5, 6, 7])
    run_job(handler, model, "rewrite", "store", [10, 11, 12, 13], [4], [0], [0, 1])
    run_job(handler, model, "again", "load", [4, 5, 6, 7], [4], [0], [0, 1])


def check_gpu_and_chunks(handler, model, chunks):
    """Every GPU block, and these CPU chunks, equal the model's."""
    views = pool_views(handler, handler.pool.tensor.numpy())
    for g, group in enumerate(handler.gpu_tensors):
        page = handler.layout.groups[g].tensors[0].page_bytes
        for t, tensor in enumerate(group):
            np.testing.assert_array_equal(views[g][t][chunks], model.cpu[g][t][chunks])
            np.testing.assert_array_equal(gpu_pages(tensor, page), model.gpu[g][t])


def copy_half_then_fail(copy, error):
    """Wraps ``copy(src, dst, sizes, ...)``: once armed, its next call copies the first half
    of the copies and raises ``error``. Returns (wrapper, arm)."""
    armed = []

    def wrapper(*args, **kwargs):
        if not armed:
            return copy(*args, **kwargs)
        armed.clear()
        src, dst, sizes = (np.asarray(a) for a in args[:3])
        half = len(sizes) // 2
        copy(src[:half], dst[:half], sizes[:half], *args[3:], **kwargs)
        raise error

    return wrapper, lambda: armed.append(True)


def interrupt_first_wait(monkeypatch, handler) -> None:
    """The handler's next wait for a job raises KeyboardInterrupt, as a signal would; the
    waits after it wait."""
    real, calls = handler._lanes.wait, []

    def interrupted(handle):
        calls.append(handle)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(handle)

    monkeypatch.setattr(handler._lanes, "wait", interrupted)


def check_cache(cache, gpu_buffers) -> None:
    """A page copy test's cache (its layout, pinned ``pool`` and ``gpu`` tensors of rows
    padded past ``pages[g]``, their first ``rows``, and its KVModel ``model``) holds what
    the model says: the pool's chunks, the GPU pages, padding never written, and every
    canary of the pool and of ``gpu_buffers`` intact."""
    torch.cuda.synchronize()
    pool = cache.pool.tensor.numpy()
    for g, group in enumerate(cache.layout.groups):
        for t, tensor in enumerate(group.tensors):
            view = np.lib.stride_tricks.as_strided(
                pool[tensor.cpu_base - cache.pool.tensor.data_ptr():],
                shape=(group.num_cpu_chunks, cache.bpc, tensor.page_bytes),
                strides=(tensor.cpu_stride, tensor.page_bytes, 1))
            np.testing.assert_array_equal(view, cache.model.cpu[g][t], f"cpu {g} {t}")
            rows = cache.gpu[g][t].cpu().numpy()
            np.testing.assert_array_equal(rows[:, :cache.pages[g]], cache.model.gpu[g][t], f"gpu {g} {t}")
            np.testing.assert_array_equal(rows[:, cache.pages[g]:], cache.rows[g][t][:, cache.pages[g]:])
    assert cache.pool.canaries_intact()
    assert all(b.canaries_intact() for b in gpu_buffers)
