"""kvoffload.jobs.handler on a machine without a GPU: jobs on host threads, the same API
and the same ordering rules as on a GPU."""

import concurrent.futures
import gc
import linecache
import signal
import sys
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch

import kvoffload.jobs.methods
import kvoffload.pool.memory
from kvoffload.jobs.handler import OffloadHandler
from kvoffload.pages.planner import CPUSpec, GPUSpec, chunks_used
from kvoffload.pool.layout import cpu_tensor_layouts, pool_bytes
from kv_model import (POISON, a_failure_mid_job_fails_that_job_only, check, check_gpu_and_chunks,
                      copy_half_then_fail, make_handler, multi_group_with_an_empty_and_an_unaligned_group,
                      run_job, soak, store_then_load_skipping_first_blocks, submit_job)

LAYOUTS = ["chunk_major", "per_tensor"]


@pytest.mark.parametrize("cpu_layout", LAYOUTS)
@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("bpc", [1, 3])
def test_store_and_load_skipping_the_first_blocks_of_a_chunk(cpu_layout, page, bpc):
    store_then_load_skipping_first_blocks("cpu", cpu_layout, page, bpc)


def test_without_a_gpu_the_default_pool_is_chunk_major():
    assert store_then_load_skipping_first_blocks("cpu", None, 64 << 10, 3).cpu_layout == "chunk_major"


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
        assert handler.store(("s", trial), GPUSpec(stored, [32], [0]), CPUSpec(chunks))
        assert handler.load(("l", trial), CPUSpec(chunks), GPUSpec(loaded, [32], [0]))
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
    assert handler.store("a", *store)
    with pytest.raises(ValueError, match=r"job_id: 'a' is already in use"):
        handler.store("a", *store)
    handler.wait(["a"])
    with pytest.raises(ValueError, match=r"job_id: 'a' is already in use"):
        handler.store("a", *store)  # finished, not yet collected
    handler.get_finished()
    model.store([0, 1], [2], [0], [0])
    before = handler.pool.tensor.clone()
    cases = [
        ((GPUSpec([0, 8], [2], [0]), CPUSpec([1])), ValueError, r"group 0: block_ids\[1\] = 8 is out of range"),
        ((GPUSpec([0, 1], [2], [0]), CPUSpec([1, 2])), ValueError, r"chunk_ids: has 2 ids but the groups use 1"),
        ((GPUSpec([0, 1], [1, 1], [0, 0]), CPUSpec([1])), ValueError, r"group_sizes: has 2 groups but the layout has 1"),
        ((GPUSpec([0], [1], [0]), GPUSpec([1], [1], [0])), TypeError, r"cpu: expected a CPUSpec, got GPUSpec"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            handler.store("b", *args)
    with pytest.raises(ValueError, match=r"expedite: only for loads"):
        handler.load("b", CPUSpec([0]), GPUSpec([2, 3], [2], [0]), expedite=True)
    assert handler.get_finished() == [] and torch.equal(handler.pool.tensor, before)
    check(handler, model)
    handler.shutdown()
    for call in (lambda: handler.load("c", CPUSpec([0]), GPUSpec([0, 1], [2], [0])), lambda: handler.store("c", *store),
                 lambda: handler.wait(["a"])):
        with pytest.raises(RuntimeError, match=r"the handler is shut down"):
            call()


def test_store_and_load_name_the_spec_they_were_given_in_the_wrong_place():
    handler, model = small_handler()
    gpu, cpu = GPUSpec([0, 1], [2], [0]), CPUSpec([0])
    before = handler.pool.tensor.clone()
    for call, message in [(lambda: handler.store("a", cpu, gpu), r"gpu: expected a GPUSpec, got CPUSpec"),
                          (lambda: handler.store("a", gpu, gpu), r"cpu: expected a CPUSpec, got GPUSpec"),
                          (lambda: handler.load("a", gpu, cpu), r"gpu: expected a GPUSpec, got CPUSpec"),
                          (lambda: handler.load("a", cpu, [0, 1]), r"gpu: expected a GPUSpec, got list")]:
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(ValueError, match=r"expedite: only for loads"):
        handler.load("a", cpu, gpu, expedite=True)  # made without expedited_loads
    assert handler.get_finished() == [] and torch.equal(handler.pool.tensor, before)
    check(handler, model)
    handler.shutdown()


def test_specs_with_names_of_their_own_are_named_so_in_every_error():
    handler, model = small_handler()
    names = {"block_ids": "src.blocks", "group_sizes": "src.sizes", "block_indices": "src.firsts"}
    cpu_names = {"chunk_ids": "dst.chunks"}
    before = handler.pool.tensor.clone()
    cases = [  # the spec's own checks, then the page table's
        (lambda: GPUSpec([0, 1.5], [2], [0], names=names), TypeError, r"src\.blocks"),
        (lambda: GPUSpec([0, 1], [1], [0], names=names), ValueError, r"src\.sizes: add up to 1 but src\.blocks has 2"),
        (lambda: CPUSpec([[0]], names=cpu_names), ValueError, r"dst\.chunks"),
        (lambda: handler.store("a", GPUSpec([0, 9], [2], [0], names=names), CPUSpec([0], names=cpu_names)),
         ValueError, r"group 0: src\.blocks\[1\] = 9 is out of range"),
        (lambda: handler.store("a", GPUSpec([0, 1], [2], [0], names=names), CPUSpec([0, 1], names=cpu_names)),
         ValueError, r"dst\.chunks: has 2 ids but the groups use 1"),
        (lambda: handler.store("a", GPUSpec([0, 1], [2], [0], names=names), CPUSpec([7], names=cpu_names)),
         ValueError, r"group 0: dst\.chunks\[0\] = 7 is out of range"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert handler.get_finished() == [] and torch.equal(handler.pool.tensor, before)
    check(handler, model)
    handler.shutdown()


def test_a_failure_mid_job_fails_that_job_only(monkeypatch):
    handler, model = make_handler(np.random.default_rng(6), [512], [2], num_blocks=16, num_chunks=8,
                                  bpc=2, cpu_layout="chunk_major")
    failing, arm = copy_half_then_fail(kvoffload.jobs.methods.host_copy, OSError("injected failure"))
    monkeypatch.setattr(kvoffload.jobs.methods, "host_copy", failing)
    a_failure_mid_job_fails_that_job_only(handler, model, arm)
    handler.shutdown()


def test_chunks_placed_by_the_caller_land_there_and_nowhere_else():
    # Two tensors of 96- and 32-byte pages, bpc 2, interleaved in rows of 512 bytes of a
    # caller's buffer at offsets 64 and 320; the rest of each row is never written.
    rng = np.random.default_rng(11)
    pages, bpc, chunks, row = [96, 32], 2, 6, 512
    gpu = [[torch.from_numpy(rng.integers(0, 256, (16, p), dtype=np.uint8)) for p in pages]]
    buffer = torch.full((chunks * row + 100,), POISON, dtype=torch.uint8)
    places = [[(64, row), (320, row)]]
    handler = OffloadHandler(gpu, chunks, bpc, host_buffer=buffer, cpu_places=places)
    expected = buffer.clone()
    blocks, chunk_ids = rng.permutation(16)[:5], rng.permutation(chunks)[:3]
    assert handler.store("s", GPUSpec(blocks, [5], [1]), CPUSpec(chunk_ids))
    for i, b in enumerate(blocks):  # block i: chunk (1 + i) // 2, sub-block (1 + i) % 2
        c, sub = chunk_ids[(1 + i) // bpc], (1 + i) % bpc
        for (offset, stride), page, t in zip(places[0], pages, gpu[0]):
            at = offset + c * stride + sub * page
            expected[at:at + page] = t[b]
    handler.wait(["s"])
    assert all(r.success for r in handler.get_finished())
    assert torch.equal(buffer, expected)
    targets = rng.permutation(16)[:5]
    for t in gpu[0]:
        t[targets] = POISON
    assert handler.load("l", CPUSpec(chunk_ids), GPUSpec(targets, [5], [1]))
    handler.wait(["l"])
    assert all(r.success for r in handler.get_finished())
    for t, page, (offset, stride) in zip(gpu[0], pages, places[0]):
        for i, b in enumerate(targets):
            c, sub = chunk_ids[(1 + i) // bpc], (1 + i) % bpc
            at = offset + c * stride + sub * page
            assert torch.equal(t[b], buffer[at:at + page])
    handler.shutdown()


def test_two_tensors_placed_on_one_cpu_region_are_refused():
    # Groups may share CPU chunks only where they reference one GPU tensor (hybrid models).
    a, b = (torch.full((8, 64), v, dtype=torch.uint8) for v in (1, 2))
    buffer = torch.full((1024,), POISON, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"group 0 tensor 0 and group 1 tensor 0 share their CPU chunks but "
                                         r"not their GPU tensor"):
        OffloadHandler([[a], [b]], 4, 1, host_buffer=buffer, cpu_places=[[(0, 256)], [(0, 256)]])
    shared = OffloadHandler([[a], [a[:, :32]]], 4, 1, host_buffer=buffer, cpu_places=[[(0, 256)], [(0, 256)]])
    assert shared.layout.cpu_alias == (0, 0)
    shared.shutdown()


@pytest.mark.parametrize("places,kwargs,error,message", [
    ([[(0, 256), (128, 256)]], {"buffer": False}, ValueError, r"cpu_places: places chunks in a host_buffer"),
    ([[(0, 256)]], {}, ValueError, r"cpu_places\[0\]: expected 2 \(offset, stride\) pairs"),
    ([[(0, 256), (128, 64)]], {}, ValueError, r"cpu_places\[0\]\[1\]\[1\]: must be >= 128"),
    ([[(0, 256), (-1, 256)]], {}, ValueError, r"cpu_places\[0\]\[1\]\[0\]: must be >= 0"),
    ([[(0, 256), (200, 256)]], {}, ValueError, r"cpu_places\[0\]\[1\]: chunk 3 ends at byte 1096, past the 1024"),
    ([[(0, 256), (64, 256)]], {}, ValueError, r"group 0 tensor 0 and group 0 tensor 1 overlap on the CPU side"),
    ([[(0, 256), "ab"]], {}, TypeError, r"cpu_places\[0\]\[1\]: expected \(offset, stride\)"),
])
def test_bad_cpu_places_are_named(places, kwargs, error, message):
    gpu = [[torch.zeros((8, 64), dtype=torch.uint8), torch.zeros((8, 64), dtype=torch.uint8)]]
    buffer = torch.full((1024,), POISON, dtype=torch.uint8)
    with pytest.raises(error, match=message):
        OffloadHandler(gpu, 4, 2, host_buffer=buffer if kwargs.get("buffer", True) else None, cpu_places=places)
    assert bool((buffer == POISON).all())


def test_a_tensor_resized_while_its_job_waits_on_the_lane_is_not_written():
    big = torch.zeros(256, 1 << 20, dtype=torch.uint8)  # a first load that keeps the lane busy
    cache = torch.zeros(64, 1 << 17, dtype=torch.uint8)
    handler = OffloadHandler([[big], [cache]], [256, 64], 1)
    ids = list(range(64))
    assert handler.load("slow", CPUSpec(list(range(256))), GPUSpec(list(range(256)), [256, 0], [0, 0]))
    assert handler.load("queued", CPUSpec(ids), GPUSpec(ids, [0, 64], [0, 0]))
    cache.resize_(128, 1 << 17)  # its old memory is freed
    handler.wait(["slow", "queued"])
    results = {r.job_id: r for r in handler.get_finished()}
    handler.shutdown()
    changed = "gpu_tensors[1][0]: its memory changed since it was registered"
    assert not results["queued"].success and changed in results["queued"].error
    assert results["slow"].success or changed in results["slow"].error  # if it had not started yet


@pytest.mark.parametrize("which", ["host_buffer", "gpu_tensors"])
def test_read_only_memory_is_refused_by_name(tmp_path, which):
    path = tmp_path / "kv.bin"
    path.write_bytes(bytes([POISON]) * (1 << 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's, once a process: the array is not writable
        read_only = torch.from_numpy(np.memmap(path, mode="r", dtype=np.uint8))
    cache = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"^{which}(\[0\]\[0\])?: bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) are not "
                                         "writable memory of this process"):
        if which == "host_buffer":
            OffloadHandler([[cache]], 4, 2, host_buffer=read_only)
        else:
            OffloadHandler([[read_only[:512].view(8, 64)]], 4, 2)
    assert path.read_bytes() == bytes([POISON]) * (1 << 16)
    writable = torch.from_numpy(np.memmap(path, mode="r+", dtype=np.uint8))
    handler = OffloadHandler([[cache]], 4, 2, host_buffer=writable)  # the same file, mapped for writing
    handler.shutdown()


def test_handlers_share_a_named_pool_only_with_one_layout():
    import os
    import uuid
    options = kvoffload.pool.host_pool.PoolOptions(shm_name=f"kvoffload-test-{uuid.uuid4().hex}")
    rng = np.random.default_rng(41)
    a, model = make_handler(rng, [256], [2], num_blocks=16, num_chunks=8, bpc=1, cpu_layout="chunk_major",
                            host_pool=options)
    b, _ = make_handler(rng, [256], [2], num_blocks=16, num_chunks=8, bpc=1, cpu_layout="chunk_major",
                        host_pool=options)  # the same layout (as ranks of one engine): one pool
    # Two tensors of 256 or one of 512: the same bytes, read another way.
    with pytest.raises(ValueError, match=r"shm_name: .* holds another pool \(kvoffload pool [0-9a-f]{16}: 1 groups, "
                                         r"2 tensors, chunks \[8\] of 1 blocks, chunk_major\); this one is "
                                         r"kvoffload pool [0-9a-f]{16}: 1 groups, 1 tensors"):
        make_handler(rng, [512], [1], num_blocks=16, num_chunks=8, bpc=1, cpu_layout="chunk_major",
                     host_pool=options)
    run_job(a, model, "s", "store", [1, 4], [2], [0], [2, 5])
    b.load("l", CPUSpec([2, 5]), GPUSpec([7, 9], [2], [0]))
    b.wait("l")
    for t_a, t_b in zip(a.gpu_tensors[0], b.gpu_tensors[0]):  # b loaded what a stored
        assert torch.equal(t_b[[7, 9]], t_a[[1, 4]])
    a.shutdown()
    b.shutdown()
    assert not os.path.exists(f"/dev/shm/{options.shm_name}")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(page_bytes=32), TypeError, r"page_bytes: expected one entry per group \(an int or one per tensor\), got 32"),
    (dict(page_bytes=[True]), TypeError, r"page_bytes\[0\]: expected an int or one per tensor, got True"),
    (dict(host_pool={"background": True}), TypeError, r"host_pool: expected a kvoffload.PoolOptions, got dict"),
    (dict(host_pool=kvoffload.pool.host_pool.PoolOptions(shm_name="kvoffload-test-never-made"),
          host_buffer=torch.zeros(4096, dtype=torch.uint8)), ValueError,
     r"host_pool: options of a pool the handler makes; with host_buffer the pool is the caller's"),
    (dict(expedited_loads="no"), TypeError, r"expedited_loads: expected True or False, got 'no'"),
])
def test_bad_handler_options_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        OffloadHandler([[torch.zeros((8, 64), dtype=torch.uint8)]], 4, 2, **kwargs)


@pytest.mark.parametrize("gpu_tensors, message", [
    ("ab", r"gpu_tensors: expected a sequence, got a str"),
    ([torch.zeros((8, 64), dtype=torch.uint8)], r"gpu_tensors\[0\]: expected a sequence, got a Tensor"),
    ([[np.zeros((8, 64), np.uint8)]], r"gpu_tensors\[0\]\[0\]: expected a torch tensor, got a ndarray"),
    ([[torch.zeros((8, 64), dtype=torch.uint8)], [None]], r"gpu_tensors\[1\]\[0\]: expected a torch tensor, got a NoneType"),
])
def test_gpu_tensors_that_are_not_groups_of_tensors_are_named(gpu_tensors, message):
    with pytest.raises(TypeError, match=message):
        OffloadHandler(gpu_tensors, 4, 2)


def test_a_dropped_handlers_finalizer_ends_its_lanes_through_a_ctrl_c():
    class Lanes:  # a join that Ctrl-C interrupts once
        closes = 0

        def close(self):
            Lanes.closes += 1
            if Lanes.closes == 1:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kvoffload.jobs.handler._close_quietly(Lanes())
    assert Lanes.closes == 2  # the lanes ended before the interrupt went on


def test_a_shut_down_handlers_registry_no_longer_vouches_for_its_pool():
    handler = OffloadHandler([[torch.zeros((8, 64), dtype=torch.uint8)]], 4, 2)
    base, registry = handler.pool.base, handler.registry
    src = np.arange(64, dtype=np.uint8)
    registry.register("src", src.ctypes.data, src.nbytes, "host")
    kvoffload.host_copy([src.ctypes.data], [base], [64], registry=registry)  # live: vouched for
    handler.shutdown()
    assert "host pool" not in {r.name for r in registry.regions}
    with pytest.raises(ValueError, match=r"dst\[0\]: .* is outside registered host memory"):
        kvoffload.host_copy([src.ctypes.data], [base], [64], registry=registry)


@pytest.mark.parametrize("view, bit", [(lambda t: t.conj(), "conj"), (lambda t: torch._neg_view(t), "neg")])
def test_tensors_whose_memory_is_not_their_values_are_refused(view, bit):
    plain = torch.randn((8, 32), dtype=torch.complex64)
    lazy = view(plain)
    assert getattr(lazy, f"is_{bit}")()
    with pytest.raises(ValueError, match=rf"gpu_tensors\[0\]\[1\]: has its {bit} bit set; pass tensor.resolve_{bit}\(\)"):
        OffloadHandler([[plain, lazy]], 4, 2)


def test_a_job_id_that_names_no_job_is_refused():
    handler = OffloadHandler([[torch.zeros((8, 64), dtype=torch.uint8)]], 4, 2)
    try:
        with pytest.raises(TypeError, match=r"job_id: must be hashable, got a list"):
            handler.store(["a"], GPUSpec([0, 1], [2], [0]), CPUSpec([0]))
        for job_ids in ([["a"]], torch.tensor(1), np.array(1)):
            with pytest.raises(TypeError, match=r"job_ids: expected a job id or an iterable of job ids"):
                handler.wait(job_ids)
        with pytest.raises(TypeError, match=r"expedite: expected True or False, got 'no'"):
            handler.load("l", CPUSpec([0]), GPUSpec([0, 1], [2], [0]), expedite="no")
        for _ in range(2):
            for nan in (float("nan"), np.float32("nan")):
                with pytest.raises(ValueError, match=r"job_id: NaN names no job"):
                    handler.store(nan, GPUSpec([0, 1], [2], [0]), CPUSpec([0]))
        assert handler.get_finished() == []
    finally:
        handler.shutdown()


def test_only_the_bytes_of_a_cache_need_be_writable():
    import ctypes
    import mmap
    memory = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    second = ctypes.c_void_p(whole.data_ptr() + mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mprotect(second, mmap.PAGESIZE, mmap.PROT_READ) == 0
    try:
        handler = OffloadHandler([[whole[:mmap.PAGESIZE].view(8, -1)]], 4, 2)  # the first page: writable
        handler.shutdown()
        with pytest.raises(ValueError, match=r"^gpu_tensors\[0\]\[0\]: bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) are not writable"):
            OffloadHandler([[whole.view(8, -1)]], 4, 2)
    finally:
        assert libc.mprotect(second, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE) == 0


def test_cpu_layout_with_cpu_places_is_named():
    gpu = [[torch.zeros((8, 64), dtype=torch.uint8)]]
    buffer = torch.full((1024,), POISON, dtype=torch.uint8)
    for layout in ("per_tensor", "bogus"):
        with pytest.raises(ValueError, match=rf"cpu_layout: '{layout}' cannot be given with cpu_places"):
            OffloadHandler(gpu, 4, 2, host_buffer=buffer, cpu_places=[[(0, 256)]], cpu_layout=layout)
    assert bool((buffer == POISON).all())
    handler = OffloadHandler(gpu, 4, 2, host_buffer=buffer, cpu_places=[[(0, 256)]])
    assert handler.cpu_layout is None
    handler.shutdown()


def test_host_buffer_too_small_is_rejected():
    gpu = [[torch.zeros((8, 128), dtype=torch.uint8)]]
    with pytest.raises(ValueError, match=r"host_buffer: holds 100 bytes, the layout needs 4096"):
        OffloadHandler(gpu, 4, 2, host_buffer=torch.zeros(100, dtype=torch.uint8))


def test_no_tensors_at_all_is_named():
    with pytest.raises(ValueError, match=r"gpu_tensors: no tensors in its 2 groups"):
        OffloadHandler([[], []], 4, 2)


def test_gpu_tensors_on_two_devices_are_rejected():
    gpu = [[torch.zeros((8, 128), dtype=torch.uint8), torch.zeros((8, 128), dtype=torch.uint8, device="meta")]]
    with pytest.raises(ValueError, match=r"gpu_tensors: expected one device"):
        OffloadHandler(gpu, 4, 2)



def random_job(rng, layout, blocks, chunks):
    """A random store or load of one group over these GPU blocks and CPU chunks."""
    bpc = layout.blocks_per_chunk
    first = int(rng.integers(0, bpc))
    n = int(rng.integers(1, min(len(blocks), (len(chunks) - 1) * bpc) + 1))
    ids = rng.permutation(blocks)[:n]
    chunk_ids = rng.permutation(chunks)[: chunks_used(n, first, bpc)]
    return ("store" if rng.random() < 0.5 else "load"), ids, [n], [first], chunk_ids


def submit(handler, model, job_id, direction, ids, sizes, firsts, chunk_ids):
    gpu, cpu = GPUSpec(ids, sizes, firsts), CPUSpec(chunk_ids)
    assert submit_job(handler, job_id, direction, gpu, cpu)
    getattr(model, direction)(ids, sizes, firsts, chunk_ids)


def test_every_method_is_safe_from_several_threads():
    rng = np.random.default_rng(21)
    handler, model = make_handler(rng, [256], [2], num_blocks=64, num_chunks=48, bpc=2, cpu_layout="chunk_major")
    done = threading.Event()
    collected = []

    def collect():
        while not done.is_set():
            collected.extend(handler.get_finished())

    def run(t, seed):
        # Each thread owns blocks and chunks no other thread touches: its jobs' outcome
        # depends only on their order, which is its own.
        local = np.random.default_rng(seed)
        blocks, chunks = np.arange(16 * t, 16 * t + 16), np.arange(12 * t, 12 * t + 12)
        for j in range(150):
            submit(handler, model, (t, j), *random_job(local, handler.layout, blocks, chunks))
            if local.random() < 0.1:
                handler.wait([(t, j)])
        return [(t, j) for j in range(150)]

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        collector = pool.submit(collect)
        ids = sum((f.result() for f in [pool.submit(run, t, s) for t, s in enumerate(rng.integers(1 << 30, size=4))]),
                  [])
        done.set()
        collector.result()
    handler.wait(ids)
    collected += handler.get_finished()
    assert sorted(r.job_id for r in collected) == sorted(ids) and all(r.success for r in collected)
    check(handler, model)
    assert handler.descriptor_arrays_allocated <= 600
    handler.shutdown()


class BlockToChunk:
    """Jobs over 32 chunks whose outcome does not depend on which of them ran: a store
    copies block b to chunk b, a load chunk b to block 32 + b. So whatever interrupts
    leave unsubmitted, every byte is poison, its old value, or block b's."""

    def __init__(self, rng):
        self.handler, _ = make_handler(rng, [128], [2], num_blocks=64, num_chunks=32, bpc=1,
                                       cpu_layout="chunk_major")
        self.before = [t.clone().numpy() for t in self.handler.gpu_tensors[0]]

    @staticmethod
    def specs(rng):
        b = rng.permutation(32)[: int(rng.integers(1, 5))]
        if rng.random() < 0.5:
            return GPUSpec(b, [len(b)], [0]), CPUSpec(b)
        return CPUSpec(b), GPUSpec(b + 32, [len(b)], [0])

    def submit(self, job, specs):
        if isinstance(specs[0], GPUSpec):
            return self.handler.store(job, *specs)
        return self.handler.load(job, *specs)

    def finish(self, submitted, results):
        """Waits for the jobs and checks every result and byte; shuts the handler down."""
        self.handler.wait(submitted)
        results += self.handler.get_finished()
        ids = [r.job_id for r in results]
        assert len(ids) == len(set(ids)) and all(r.success for r in results)
        pool = self.handler.pool.tensor.numpy().reshape(32, 2, 128)
        for t, tensor in enumerate(self.handler.gpu_tensors[0]):
            original, now = self.before[t], tensor.numpy()
            np.testing.assert_array_equal(now[:32], original[:32])
            for b in range(32):
                assert any((pool[b, t] == want).all() for want in (POISON, original[b]))
                assert any((now[32 + b] == want).all() for want in (POISON, original[b], original[32 + b]))
        self.handler.shutdown()


def test_repeated_sigints_leave_the_handler_usable():
    rng = np.random.default_rng(22)
    jobs = BlockToChunk(rng)
    armed = [False]

    def on_sigint(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def interrupted(call):
        try:
            armed[0] = True
            value = call()
            armed[0] = False
            return value, False
        except KeyboardInterrupt:
            return None, True

    def storm(seed):
        local = np.random.default_rng(seed)
        while not stop.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(local.uniform(0, 5e-5))

    previous = signal.signal(signal.SIGINT, on_sigint)
    stop = threading.Event()
    storm_thread = threading.Thread(target=storm, args=(int(rng.integers(1 << 30)),))
    storm_thread.start()
    submitted, results, interrupts = [], [], 0
    try:
        for job in range(1500):
            specs = jobs.specs(rng)
            _, hit = interrupted(lambda: jobs.submit(job, specs))
            submitted += [] if hit else [job]
            finished, hit_finished = interrupted(jobs.handler.get_finished)
            results += finished or []
            _, hit_wait = interrupted(lambda: jobs.handler.wait(submitted[-rng.integers(1, 5):]))
            interrupts += hit + hit_finished + hit_wait
    finally:
        stop.set()
        storm_thread.join()
        signal.signal(signal.SIGINT, previous)
    assert interrupts > 0
    jobs.finish(submitted, results)


_INTERRUPTIBLE = ("kvoffload/jobs/handler.py", "kvoffload/jobs/methods.py", "kvoffload/jobs/lanes.py",
                  "kvoffload/jobs/descriptor_pool.py", "kvoffload/jobs/conflicts.py", "kvoffload/jobs/accesses.py",
                  "/threading.py", "/queue.py", "concurrent/futures/_base.py", "concurrent/futures/thread.py")


def interrupt_at_line(n, call) -> bool:
    """Runs ``call`` with a KeyboardInterrupt raised at the n-th line it runs in the
    handler, its lanes or Python's threading code; returns whether it was raised.

    Not at a ``with`` line: the tracer sees it again as the block exits, where Python
    checks for signals only once the context manager's __exit__ has run."""
    lines = [0]

    def local(frame, event, arg):
        if event == "line" and not linecache.getline(frame.f_code.co_filename, frame.f_lineno).lstrip().startswith("with "):
            lines[0] += 1
            if lines[0] == n:
                raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename.endswith(_INTERRUPTIBLE) else None)
    try:
        call()
        return False
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)


def test_an_interrupt_at_any_line_leaves_the_handler_usable():
    rng = np.random.default_rng(26)
    jobs = BlockToChunk(rng)
    submitted, results = [], []
    n = 0
    while True:  # one job per line the job's calls run, interrupted at that line
        n += 1
        job, specs = n, jobs.specs(rng)
        calls = [lambda: jobs.submit(job, specs), lambda: submitted.append(job),
                 lambda: jobs.handler.wait(submitted[-3:]), lambda: results.extend(jobs.handler.get_finished())]
        if not interrupt_at_line(n, lambda: [call() for call in calls]):
            break
    assert n > 50
    jobs.finish(submitted, results)


@pytest.fixture
def gated_failure(monkeypatch):
    """(arm, gate): once armed, the next host copy copies half and fails; every host copy
    waits while the gate is clear."""
    gate = threading.Event()
    gate.set()
    failing, arm = copy_half_then_fail(kvoffload.jobs.methods.host_copy, OSError("injected failure"))

    def gated(*args, **kwargs):
        gate.wait()
        return failing(*args, **kwargs)

    monkeypatch.setattr(kvoffload.jobs.methods, "host_copy", gated)
    yield arm, gate
    gate.set()  # a failed test leaves no worker waiting


def test_a_partial_restore_keeps_the_failed_sub_blocks_partial(gated_failure):
    rng = np.random.default_rng(23)
    for trial in range(5):
        bpc = int(rng.integers(2, 6))
        handler, model = make_handler(rng, [int(rng.integers(1, 5)) * 64], [2], num_blocks=24, num_chunks=6,
                                      bpc=bpc, cpu_layout="chunk_major")
        arm, _ = gated_failure
        chunk = int(rng.integers(6))
        split = int(rng.integers(1, bpc))
        arm()
        handler.store("bad", GPUSpec(rng.permutation(24)[:split], [split], [0]), CPUSpec([chunk]))
        submit(handler, model, "good", "store", rng.permutation(24)[: bpc - split], [bpc - split], [split], [chunk])
        handler.wait(["bad", "good"])
        results = {r.job_id: r.success for r in handler.get_finished()}
        assert results == {"bad": False, "good": True}
        assert not handler.load("whole", CPUSpec([chunk]), GPUSpec(rng.permutation(24)[:bpc], [bpc], [0]))
        (whole,) = handler.get_finished()
        assert not whole.success and "left partial by failed store 'bad'" in whole.error
        submit(handler, model, "rewritten part", "load", rng.permutation(24)[: bpc - split], [bpc - split],
               [split], [chunk])
        handler.wait("rewritten part")
        assert [r.success for r in handler.get_finished()] == [True]
        check_gpu_and_chunks(handler, model, chunks=[c for c in range(6) if c != chunk])
        handler.shutdown()


def armed_handler(gated_failure, seed):
    """A handler whose chunks 4 and 5 hold a first store, and whose next job fails once
    the gate opens."""
    handler, model = make_handler(np.random.default_rng(seed), [256], [2], num_blocks=16, num_chunks=8, bpc=2,
                                  cpu_layout="chunk_major")
    run_job(handler, model, "first", "store", [8, 9, 10, 11], [4], [0], [4, 5])
    arm, gate = gated_failure
    gate.clear()
    arm()
    return handler, model, gate


def test_a_failed_store_fails_only_the_loads_of_its_bytes(gated_failure):
    handler, model, gate = armed_handler(gated_failure, 24)
    handler.store("bad", GPUSpec([0, 1, 2, 3], [4], [0]), CPUSpec([0, 1]))
    # While it runs: a load over the blocks it reads, a store behind it, a load of its bytes.
    submit(handler, model, "overwrites its blocks", "load", [0, 1, 2, 3], [4], [0], [4, 5])
    submit(handler, model, "next store", "store", [12, 13], [2], [0], [2])
    handler.load("reads its bytes", CPUSpec([1]), GPUSpec([6, 7], [2], [0]))
    gate.set()
    handler.wait(["bad", "overwrites its blocks", "next store", "reads its bytes"])
    results = {r.job_id: r for r in handler.get_finished()}
    assert [name for name, r in results.items() if not r.success] == ["bad", "reads its bytes"]
    assert "injected" in results["reads its bytes"].error
    check_gpu_and_chunks(handler, model, chunks=[2, 3, 4, 5, 6, 7])
    handler.shutdown()


def test_a_store_of_blocks_a_failed_load_was_writing_fails_naming_it(gated_failure):
    handler, model, gate = armed_handler(gated_failure, 26)
    handler.load("bad load", CPUSpec([4, 5]), GPUSpec([0, 1, 2, 3], [4], [0]))
    # Ordered after the load: it would store what the failed load left in blocks 2 and 3.
    handler.store("stores its blocks", GPUSpec([2, 3], [2], [0]), CPUSpec([6]))
    submit(handler, model, "other blocks", "store", [12, 13], [2], [0], [2])
    gate.set()
    handler.wait(["bad load", "stores its blocks", "other blocks"])
    results = {r.job_id: r for r in handler.get_finished()}
    assert {name for name, r in results.items() if not r.success} == {"bad load", "stores its blocks"}
    assert "injected" in results["stores its blocks"].error
    # Chunk 6 is partial: its loads fail rather than return what the failed load left.
    handler.load("reads chunk 6", CPUSpec([6]), GPUSpec([14, 15], [2], [0]))
    handler.wait("reads chunk 6")
    (last,) = handler.get_finished()
    assert not last.success and "left partial by failed store 'stores its blocks'" in last.error
    handler.shutdown()


def test_a_load_submitted_as_a_failed_store_ends_fails(gated_failure, monkeypatch):
    # The store ends (failed) after the load's submit collected finished jobs and before
    # it looked for the stores in flight: no longer in flight, not yet known to fail.
    rng = np.random.default_rng(25)
    handler, model = make_handler(rng, [256], [2], num_blocks=16, num_chunks=8, bpc=2, cpu_layout="chunk_major")
    arm, gate = gated_failure
    gate.clear()
    arm()
    handler.store("bad", GPUSpec([0, 1, 2, 3], [4], [0]), CPUSpec([0, 1]))
    bad, collect = handler._in_flight["bad"].handle, handler._collect

    def collect_then_the_store_ends():
        collect()
        gate.set()
        handler._lanes.wait(bad)

    monkeypatch.setattr(handler, "_collect", collect_then_the_store_ends)
    assert handler.load("reads its bytes", CPUSpec([1]), GPUSpec([6, 7], [2], [0]))
    monkeypatch.setattr(handler, "_collect", collect)
    handler.wait(["bad", "reads its bytes"])
    results = {r.job_id: r for r in handler.get_finished()}
    assert not results["bad"].success and not results["reads its bytes"].success
    assert "injected" in results["reads its bytes"].error
    handler.shutdown()


def test_wait_takes_one_id_or_a_collection_and_refuses_unknown_ids(gated_failure):
    handler, model = small_handler()
    _, gate = gated_failure
    for one_id in ("job-1", ("s", 1), 7, frozenset({"r", 2})):
        gate.clear()
        assert handler.store(one_id, GPUSpec([0, 1], [2], [0]), CPUSpec([0]))
        waiter = threading.Thread(target=handler.wait, args=(one_id,))
        waiter.start()
        assert not handler.get_finished()  # the gate holds the job
        gate.set()
        waiter.join()
        (result,) = handler.get_finished()
        assert result.job_id == one_id and result.success
    handler.wait({"job-1", ("s", 1)})
    handler.wait(iter([7]))
    for unknown in ("job-2", ["job-1", "job-2"], ("s", 2), 8):
        with pytest.raises(ValueError, match=r"job_ids: .* was never submitted"):
            handler.wait(unknown)
    handler.shutdown()


class CountingId:
    """A job id that counts how often it is compared."""

    compared = 0

    def __init__(self, n):
        self.n = n

    def __hash__(self):
        return hash(self.n)

    def __eq__(self, other):
        CountingId.compared += 1
        return isinstance(other, CountingId) and other.n == self.n


def test_submitting_costs_the_same_however_many_jobs_are_in_flight_or_uncollected(monkeypatch, gated_failure):
    rng = np.random.default_rng(25)
    handler, model = make_handler(rng, [64], [1], num_blocks=400, num_chunks=400, bpc=1, cpu_layout="chunk_major")
    _, gate = gated_failure
    lanes_asked = []
    done = handler._lanes.done
    monkeypatch.setattr(handler._lanes, "done", lambda handle: lanes_asked.append(1) or done(handle))
    for jobs in (10, 300):
        gate.clear()
        ids = [CountingId((jobs, j)) for j in range(jobs)]
        for i, job_id in enumerate(ids):
            handler.store(job_id, GPUSpec([i], [1], [0]), CPUSpec([i]))
        lanes_asked.clear()
        handler.store(CountingId((jobs, "in flight")), GPUSpec([jobs], [1], [0]), CPUSpec([jobs]))
        assert len(lanes_asked) <= 2  # the oldest job of each lane, not every job in flight
        gate.set()
        handler.wait(ids)
        CountingId.compared = 0
        handler.store(CountingId((jobs, "uncollected")), GPUSpec([jobs + 1], [1], [0]), CPUSpec([jobs + 1]))
        assert CountingId.compared <= 2  # not one comparison per uncollected result
        handler.wait(list(handler._in_flight))
        assert len(handler.get_finished()) == jobs + 2
    handler.shutdown()


def test_page_bytes_do_not_skip_the_contiguity_check():
    rng = np.random.default_rng(27)
    for _ in range(5):
        blocks, heads, dim = (int(x) for x in rng.integers(2, 9, 3))
        cache = torch.from_numpy(rng.integers(0, 256, (blocks, heads, dim, 2), dtype=np.uint8))  # K and V interleaved
        page = int(rng.integers(1, heads * dim + 1))
        for page_bytes in (None, [page]):
            with pytest.raises(ValueError, match=r"gpu_tensors\[0\]\[0\]: each block \(dims 1 and up\) must be contiguous"):
                OffloadHandler([[cache[..., 0]]], 4, 2, page_bytes=page_bytes)
        with pytest.raises(ValueError, match=rf"page_bytes\[0\]: {heads * dim * 2 + 1} exceeds"):
            OffloadHandler([[cache]], 4, 2, page_bytes=[heads * dim * 2 + 1])


def test_a_host_buffer_overlapping_the_kv_tensors_is_refused():
    rng = np.random.default_rng(28)
    memory = torch.from_numpy(rng.integers(0, 256, 1 << 16, dtype=np.uint8))
    before = memory.clone()
    tensor = memory[8192:8192 + 16 * 256].view(16, 256)
    need = pool_bytes([[256]], [4], 2)
    # The pool ends inside the tensor, starts inside it, or holds it whole.
    for start in (8192 + 256 - need, 8192 + int(rng.integers(0, 16 * 256)), 4096):
        with pytest.raises(ValueError, match=r"host_buffer: overlaps gpu_tensors\[0\]\[0\]"):
            OffloadHandler([[tensor]], 4, 2, host_buffer=memory[start:start + 2 * need])
    assert torch.equal(memory, before)
    handler = OffloadHandler([[tensor]], 4, 2, host_buffer=memory[8192 + 16 * 256:])
    handler.shutdown()


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(blocks_per_chunk=0), ValueError, r"blocks_per_chunk: must be >= 1, got 0"),
    (dict(num_cpu_chunks=np.int64(4)), None, None),
    (dict(num_cpu_chunks=[np.int64(4), -1]), ValueError, r"num_cpu_chunks\[1\]: must be >= 0, got -1"),
    (dict(num_cpu_chunks=4.0), TypeError, r"num_cpu_chunks: expected an int or one per group, got float"),
    (dict(page_bytes=[64]), ValueError, r"page_bytes: has 1 entries for 2 groups"),
    (dict(page_bytes=[64, 0]), ValueError, r"page_bytes\[1\]: must be >= 1, got 0"),
    (dict(host_buffer=np.zeros(1 << 16, np.uint8)), TypeError, r"host_buffer: expected a CPU torch tensor, got ndarray"),
])
def test_constructor_errors_name_the_argument(kwargs, error, message):
    gpu = [[torch.zeros((8, 128), dtype=torch.uint8)], [torch.zeros((8, 64), dtype=torch.uint8)]]
    args = dict(num_cpu_chunks=4, blocks_per_chunk=2) | kwargs
    if error is None:
        OffloadHandler(gpu, **args).shutdown()
        return
    with pytest.raises(error, match=message):
        OffloadHandler(gpu, **args)


def test_a_host_pool_that_cannot_be_allocated_on_cpu_does_not_say_pinned(monkeypatch):
    monkeypatch.setattr(kvoffload.pool.memory, "mem_available", lambda: 1024)
    with pytest.raises(RuntimeError, match=r"not enough memory: the pool needs") as info:
        OffloadHandler([[torch.zeros((8, 128), dtype=torch.uint8)]], 4, 2)
    assert "pinned" not in str(info.value)


def test_a_handler_dropped_with_jobs_not_collected_is_freed_without_the_cycle_collector():
    # What a job keeps until it is collected (its keys, queued for the access tables)
    # must not keep the handler, and its pool, alive.
    rng = np.random.default_rng(11)
    gc.disable()
    try:
        handler, _ = make_handler(rng, [128], [2], num_blocks=8, num_chunks=4, bpc=2, cpu_layout="chunk_major")
        for i in range(3):
            handler.store(i, GPUSpec(rng.permutation(8)[:2], [2], [0]), CPUSpec([i]))
        handler.wait([0, 1, 2])
        dropped = weakref.ref(handler)
        del handler
        assert dropped() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("cpu_layout", LAYOUTS)
@pytest.mark.parametrize("groups, pages, rewrite, rewritten", [
    # One tensor in two groups of other pages: sub-block k of a chunk lies at other bytes in each.
    ("T,T", [512, 256], ([1], [1, 0], [0, 0]), [0]),  # rewrites group 0's sub-block 0
    ("T,T", [512, 256], ([1], [0, 1], [0, 0]), []),  # rewrites half of it, through group 1
    # Groups of equal pages sharing one tensor, each with one of its own.
    ("TA,TB", [256, 256], ([1], [0, 1], [0, 0]), []),  # rewrites T's part of sub-block 0, not A's
])
def test_a_store_to_part_of_a_chunk_a_failed_store_wrote_leaves_the_rest_partial(gated_failure, groups, pages,
                                                                                  rewrite, rewritten, cpu_layout):
    rng = np.random.default_rng(25)
    made = {name: torch.from_numpy(rng.integers(0, 256, (16, 512), dtype=np.uint8)) for name in "TAB"}
    handler = OffloadHandler([[made[t] for t in group] for group in groups.split(",")], 4, 4, page_bytes=pages,
                             cpu_layout=cpu_layout)
    arm, _ = gated_failure
    arm()  # the store copies its first two blocks (sub-blocks 0 and 1) and fails
    handler.store("bad", GPUSpec([0, 2, 4, 6], [4, 0], [0, 0]), CPUSpec([1]))
    handler.store("good", GPUSpec(*rewrite), CPUSpec([1]))
    handler.wait(["bad", "good"])
    assert {r.job_id: r.success for r in handler.get_finished()} == {"bad": False, "good": True}
    for sub in (3, 2, 1, 0):  # group 0's sub-blocks of the chunk (3 and 2 never copied)
        assert handler.load(f"load {sub}", CPUSpec([1]), GPUSpec([8], [1, 0], [sub, 0])) == (sub in rewritten)
        handler.wait(f"load {sub}")
        (load,) = handler.get_finished()
        assert load.success or "left partial by failed store 'bad'" in load.error
    handler.shutdown()


def test_wait_while_another_thread_shuts_down_waits_for_the_jobs(gated_failure):
    # vLLM may wait for a job on one thread while another shuts the worker down.
    _, gate = gated_failure
    rng = np.random.default_rng(31)
    handler, model = make_handler(rng, [256], [2], num_blocks=16, num_chunks=8, bpc=1, cpu_layout="chunk_major")
    gate.clear()  # the store's host copy waits
    assert handler.store("a", GPUSpec([3, 5], [2], [0]), CPUSpec([1, 2]))
    outcomes = {}

    def call(name, fn):
        try:
            fn()
            outcomes[name] = None
        except BaseException as e:  # noqa: BLE001 - checked below
            outcomes[name] = e

    closing = threading.Thread(target=call, args=("shutdown", handler.shutdown))
    closing.start()
    deadline = time.monotonic() + 30
    while not handler._closing and time.monotonic() < deadline:
        time.sleep(0.001)
    assert handler._closing and not handler.shut_down
    waiting = threading.Thread(target=call, args=("wait", lambda: handler.wait("a")))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive(), "wait() returned before its job could run"
    gate.set()
    closing.join(30)
    waiting.join(30)
    assert outcomes == {"shutdown": None, "wait": None}
    assert handler.shut_down
    with pytest.raises(RuntimeError, match="the handler is shut down"):
        handler.wait("a")


def test_numpy_integers_are_taken_as_counts():
    rng = np.random.default_rng(43)
    handler, model = make_handler(rng, [128], [2], num_blocks=np.int64(16), num_chunks=np.int32(8),
                                  bpc=np.int64(2), cpu_layout="chunk_major")
    run_job(handler, model, "s", "store", [3, 4, 9], [3], [0], [1, 6])
    run_job(handler, model, "l", "load", [0, 1, 2], [3], [0], [1, 6])
    handler.shutdown()
