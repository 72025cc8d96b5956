"""kvoffload.pool.host_pool on a GPU: every registration page-locked and copied from, jobs across
the registrations' edges, a CUDA-graph capture while the pool pins, the cudaHostAlloc fallback,
a pool shared by two processes, and nothing left registered after release()."""

import multiprocessing
import os
import threading
import uuid

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload import _C
from kvoffload.pages.planner import CPUSpec, GPUSpec
from kvoffload.pool.host_pool import HostPool, PoolOptions
from kv_model import check, make_handler
from proc_maps import mapping
from calibrated import quick_calibration  # noqa: F401 - autouse

MiB = 1 << 20


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


def copy_in_and_out(pool, offset, nbytes):
    """Copies pool bytes [offset, offset + nbytes) to the GPU and back to the next bytes."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    kv.batch_copy([pool.base + offset], [device.data_ptr()], [nbytes], stream, registry=kv.UNCHECKED)
    kv.batch_copy([device.data_ptr()], [pool.base + offset + nbytes], [nbytes], stream,
                  registry=kv.UNCHECKED)
    stream.synchronize()


def test_every_registration_is_page_locked_and_copies_and_release_unregisters():
    pool = HostPool(64 * MiB + 3 * 4096, options=PoolOptions(registration_bytes=8 * MiB))
    assert pool.ready()
    edges = [pool.base + k * 8 * MiB for k in range(9)] + [pool.base + pool.nbytes - 1]
    assert all(_C.is_pinned_host(a) for a in edges)
    rng = np.random.default_rng(0)
    # The first, a middle and the last full registration, and the last 12 KiB registration.
    for offset, nbytes in ((0, MiB), (24 * MiB, MiB), (62 * MiB, MiB), (64 * MiB, 4096)):
        pool.array[offset:offset + nbytes] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        copy_in_and_out(pool, offset, nbytes)
        np.testing.assert_array_equal(pool.array[offset + nbytes:offset + 2 * nbytes],
                                      pool.array[offset:offset + nbytes])
    view = pool.array[:10]
    pool.release()
    assert mapping(pool.base) is not None and not _C.is_pinned_host(pool.base)  # mapped, unregistered
    del view
    assert mapping(pool.base) is None


def test_registering_a_range_twice_is_a_named_cuda_error():
    pool = HostPool(MiB)
    with pytest.raises(kv.CudaError, match="cudaHostRegister: cudaErrorHostMemoryAlreadyRegistered"):
        _C.pool_register(pool.base, MiB, 0)
    pool.release()


@pytest.mark.parametrize("cpu_layout", ["chunk_major", "per_tensor"])
@pytest.mark.parametrize("method", ["batch", "auto", "pages", "pages_staged", "pages_dma", "pages_kernel"])
def test_jobs_whose_runs_cross_registrations(cpu_layout, method):
    rng = np.random.default_rng(1)
    # 64 KiB chunks, a registration every 4 chunks: storing consecutive blocks to consecutive
    # chunks makes runs that the planner merges across registrations.
    handler, model = make_handler(rng, [64 << 10], [1], num_blocks=64, num_chunks=64, bpc=1,
                                  cpu_layout=cpu_layout, device="cuda", method=method,
                                  host_pool=PoolOptions(registration_bytes=256 << 10))
    ids = np.arange(64)
    assert handler.store("store", GPUSpec(ids, [64], [0]), CPUSpec(ids))
    handler.wait(["store"])
    model.store(ids, [64], [0], ids)
    loaded = np.roll(ids, 5)
    assert handler.load("load", CPUSpec(ids[2:50]), GPUSpec(loaded[2:50], [48], [0]))
    handler.wait(["load"])
    model.load(loaded[2:50], [48], [0], ids[2:50])
    assert all(r.success for r in handler.get_finished())
    check(handler, model)
    handler.shutdown()


def test_registration_during_a_graph_capture_on_another_thread(monkeypatch):
    capturing, registered = threading.Event(), threading.Event()
    register = _C.pool_register

    def register_during_capture(address, nbytes, device):
        capturing.wait()
        try:
            register(address, nbytes, device)
        finally:
            registered.set()

    monkeypatch.setattr(_C, "pool_register", register_during_capture)
    x = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.synchronize()
    x.zero_()
    graph = torch.cuda.CUDAGraph()
    pool = HostPool(64 * MiB, options=PoolOptions(background=True, registration_bytes=16 * MiB))
    with torch.cuda.graph(graph):  # global capture mode, torch's default
        x.add_(1)
        capturing.set()
        registered.wait()  # a cudaHostRegister ran on the pool's thread meanwhile
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert (x == 2).all()
    assert pool.wait() and _C.is_pinned_host(pool.base + pool.nbytes - 1)
    pool.release()


def test_graph_captures_while_a_large_pool_pins_in_the_background():
    x = torch.zeros(1024, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    pool = HostPool(4 << 30, options=PoolOptions(background=True, registration_bytes=64 * MiB))
    captures = during = 0
    while captures < 3 or not pool.ready():
        during += not pool.ready()
        graph = torch.cuda.CUDAGraph()
        x.zero_()
        with torch.cuda.graph(graph):
            x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert (x == 1).all()
        captures += 1
    assert during >= 1, "the pool was pinned before the first capture began"
    pool.release()


def test_without_registration_the_pool_is_cuda_host_alloc_memory(monkeypatch):
    monkeypatch.setattr(_C, "pool_register_supported", lambda device: False)
    with pytest.warns(RuntimeWarning, match="cudaHostAlloc"):
        pool = HostPool(8 * MiB)
    assert pool.ready() and _C.is_pinned_host(pool.base)
    pool.array[:MiB] = 7
    copy_in_and_out(pool, 0, MiB)
    assert (pool.array[MiB:2 * MiB] == 7).all()
    base = pool.base
    pool.release()
    assert not _C.is_pinned_host(base)


def attach_pin_and_fill(name, nbytes, conn):
    try:
        pool = HostPool(nbytes, options=PoolOptions(shm_name=name))
        source = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        kv.batch_copy([source.data_ptr()], [pool.base], [nbytes], torch.cuda.current_stream(),
                      registry=kv.UNCHECKED)
        torch.cuda.synchronize()
        conn.send((pool.memory.shared_file.created, _C.is_pinned_host(pool.base)))
        pool.release()
    except BaseException as e:  # the parent fails with it rather than waiting forever
        conn.send(repr(e))
        raise


def test_two_processes_pin_one_shared_pool():
    name = f"kvoffload-test-{uuid.uuid4().hex}"
    pool = HostPool(4 * MiB, options=PoolOptions(shm_name=name))
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=attach_pin_and_fill, args=(name, 4 * MiB, child))
    process.start()
    assert parent.poll(120), "the child neither attached nor failed"
    assert parent.recv() == (False, True)  # attached, and pinned there too
    process.join()
    assert process.exitcode == 0
    assert (pool.array == 7).all() and _C.is_pinned_host(pool.base)
    pool.release()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_the_gpus_numa_node_is_known_or_minus_one():
    assert _C.pool_numa_node(0) >= -1
