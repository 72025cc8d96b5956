"""Hostile callers of kvoffload.jobs.handler on CPU (issue 30): ids kept for wait(), a handler
used after fork, pinning waited for outside the lock, storage swapped under registered
tensors, tensors shared by groups, and the errors that name the field."""

import collections
import concurrent.futures
import ctypes
import os
import select
import signal
import threading
import time

import numpy as np
import pytest
import torch

import kvoffload._C
from kvoffload.jobs.handler import OffloadHandler
from kvoffload.pages.planner import CPUSpec, GPUSpec
from kvoffload.pool.host_pool import PoolOptions
from kv_model import check, interrupt_first_wait, make_handler, run_job


def small_handler(**kwargs):
    rng = np.random.default_rng(0)
    return make_handler(rng, [128], [2], num_blocks=8, num_chunks=4, bpc=2, cpu_layout="chunk_major",
                        **kwargs)


def entries(handler) -> int:
    """Items in every container the handler and its lanes hold: what grows with jobs kept."""
    return sum(len(v) for obj in (handler, handler._lanes, handler._conflicts, handler._conflicts._reported)
               for v in vars(obj).values() if isinstance(v, (set, dict, list, collections.deque)))


def test_the_ids_kept_for_wait_do_not_grow_with_the_jobs_run():
    handler, model = small_handler()
    batch, total = 64, 100_000
    kept = OffloadHandler.COLLECTED_IDS_KEPT
    counts, job_id = [], 0
    for _ in range(total // batch):
        ids = list(range(job_id, job_id + batch))
        for k in ids:
            assert handler.store(k, GPUSpec([k % 8], [1], [0]), CPUSpec([k % 4]))
        job_id += batch
        handler.wait(ids)
        assert sorted(r.job_id for r in handler.get_finished()) == ids
        counts.append(entries(handler))
    assert max(counts[-50:]) <= counts[(kept + batch) // batch] + 16, counts[::100]  # flat once it is full
    # What wait() still knows: a recent collected id returns at once; one never submitted,
    # or reported more than COLLECTED_IDS_KEPT jobs ago, raises.
    handler.wait(job_id - kept)
    for unknown in (job_id, -1, 0, job_id - kept - 1):
        with pytest.raises(ValueError, match=r"job_ids: .* was never submitted"):
            handler.wait(unknown)
    handler.wait([job_id, -1, 0], ignore_unknown=True)
    for k in range(job_id - 4, job_id):  # the last store into each chunk holds its bytes
        model.store([k % 8], [1], [0], [k % 4])
    check(handler, model)
    handler.shutdown()


def test_a_forked_child_is_refused_and_the_parent_goes_on():
    handler, model = small_handler()
    run_job(handler, model, "before", "store", [0, 1], [2], [0], [0])
    # A thread of the parent holds the handler's lock across the fork: the child's check
    # must come before the lock, or the child hangs on it.
    held, release = threading.Event(), threading.Event()

    def hold():
        with handler._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(60)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report every call's outcome, never return into pytest
        try:
            calls = {"store": lambda: handler.store("child", GPUSpec([2, 3], [2], [0]), CPUSpec([1])),
                     "wait": lambda: handler.wait("before"), "get_finished": handler.get_finished,
                     "fence": handler.fence, "shutdown": handler.shutdown}
            lines = []
            for name, call in calls.items():
                try:
                    lines.append(f"{name}: returned {call()!r}")
                except Exception as e:  # noqa: BLE001 - reported to the parent
                    lines.append(f"{name}: {type(e).__name__}: {e}")
            os.write(write, ("\n".join(lines) + "\n").encode())
        finally:
            os._exit(0)
    os.close(write)
    release.set()
    holder.join()
    out, deadline = b"", time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([read], [], [], 1)[0]:
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            out += chunk
    os.close(read)
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    else:
        deadline = None
    if deadline is not None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the child hung; it reported {out.decode()!r}")
    lines = out.decode().splitlines()
    assert [line.split(":")[0] for line in lines] == ["store", "wait", "get_finished", "fence", "shutdown"]
    for line in lines:
        assert f"RuntimeError: this handler was made in process {os.getpid()} and cannot be used in process " \
               f"{pid}, a child forked from it" in line, line
    # The parent's handler is untouched: its chunk 0 holds the stored blocks, and jobs run.
    check(handler, model)
    run_job(handler, model, "after", "load", [4, 5], [2], [0], [0])
    assert [r.job_id for r in handler.get_finished()] == []
    handler.shutdown()


def test_a_job_waiting_for_pinning_does_not_block_the_other_threads(monkeypatch):
    # Real background pinning on CPU (first touch), held up by a gate on the touch.
    gate, touching = threading.Event(), threading.Event()
    touch = kvoffload._C.pool_touch

    def slow_touch(*args):
        touching.set()
        assert gate.wait(60)
        return touch(*args)

    monkeypatch.setattr(kvoffload._C, "pool_touch", slow_touch)
    rng = np.random.default_rng(31)
    handler, model = make_handler(rng, [256], [2], num_blocks=8, num_chunks=6, bpc=2, cpu_layout="chunk_major",
                                  host_pool=PoolOptions(background=True, wait_for_pinning=True))
    assert touching.wait(60) and handler.pool.pinned_bytes == 0
    threads = concurrent.futures.ThreadPoolExecutor(4)
    try:
        store = threads.submit(handler.store, "store", GPUSpec([5, 2, 7], [3], [1]), CPUSpec([4, 1]))
        time.sleep(0.2)
        assert not store.done()  # waiting for the pinning
        for call in (handler.get_finished, lambda: handler.wait([]),
                     lambda: handler.wait("never", ignore_unknown=True)):
            threads.submit(call).result(timeout=10)  # not held up by the waiting submission
        assert not store.done()
    finally:
        gate.set()
    assert store.result(timeout=60)
    threads.shutdown()
    handler.wait("store")
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [("store", True)]
    model.store([5, 2, 7], [3], [1], [4, 1])
    check(handler, model)
    handler.shutdown()


@pytest.mark.parametrize("shared_first", [False, True])
def test_a_tensor_two_groups_view_differently_is_registered_for_both_views(shared_first):
    rng = np.random.default_rng(40 + shared_first)
    a = torch.from_numpy(rng.integers(0, 256, (8, 64), dtype=np.uint8))
    groups = [[a], [a[:, :32]]] if shared_first else [[a[:, :32]], [a]]
    wide = 0 if shared_first else 1
    handler = OffloadHandler(groups, 4, 2)
    handler.pool.tensor.fill_(0xA5)
    original = a.clone()
    # The wide view's last blocks reach past the narrow view's span: both must be registered.
    sizes = [2, 0] if wide == 0 else [0, 2]
    gpu = GPUSpec([6, 7], sizes, [0, 0])
    assert handler.store("store", gpu, CPUSpec([3]))
    handler.wait("store")
    a[6:8] = 0
    assert handler.load("load", CPUSpec([3]), gpu)
    handler.wait("load")
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [("store", True), ("load", True)]
    assert torch.equal(a, original)  # all 64 bytes of blocks 6 and 7 went there and back
    handler.shutdown()


def swap_set(t):
    t.set_(torch.zeros_like(t))


def swap_resize_larger(t):
    t.resize_(t.shape[0] * 4096, *t.shape[1:])  # a new allocation: the old one is freed


def swap_resize_smaller(t):
    t.resize_(t.shape[0] // 2, *t.shape[1:])


def swap_data(t):
    t.data = torch.zeros_like(t)


def swap_storage_freed(t):
    # Frees the memory under the held storage, then set_()s the tensor onto a new storage
    # at that address, as one the allocator hands on there would be: data_ptr, shape and
    # strides are as registered.
    address, shape, stride = t.data_ptr(), t.shape, t.stride()
    t.untyped_storage().resize_(0)
    at_address = (ctypes.c_uint8 * (t.numel() * t.element_size())).from_address(address)
    t.set_(torch.from_numpy(np.ctypeslib.as_array(at_address)).untyped_storage(), 0, shape, stride)
    assert (t.data_ptr(), t.shape, t.stride()) == (address, shape, stride)


SWAPS = [swap_set, swap_resize_larger, swap_resize_smaller, swap_data, swap_storage_freed]


def swappable_handler(rng):
    """A handler over two random tensors whose storage can be resized, and a poisoned
    host_buffer as its pool."""
    tensors = [torch.randint(0, 256, (8, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(
        int(rng.integers(1 << 30)))) for _ in range(2)]
    host = torch.full((1 << 16,), 0xA5, dtype=torch.uint8)
    return OffloadHandler([tensors], 4, 2, host_buffer=host), tensors, host


@pytest.mark.parametrize("swap", SWAPS)
def test_a_kv_tensor_whose_storage_is_swapped_is_refused_naming_it(swap):
    rng = np.random.default_rng(50)
    handler, tensors, host = swappable_handler(rng)
    assert handler.store("before", GPUSpec([0, 1], [2], [0]), CPUSpec([0]))
    handler.wait("before")
    stored = host.clone()
    swap(tensors[1])
    for submit in (lambda: handler.store("store", GPUSpec([2, 3], [2], [0]), CPUSpec([1])),
                   lambda: handler.load("load", CPUSpec([0]), GPUSpec([0, 1], [2], [0]))):
        with pytest.raises(ValueError, match=r"gpu_tensors\[0\]\[1\]: its memory changed since it was registered"):
            submit()
    assert torch.equal(host, stored)  # nothing copied
    assert [r.job_id for r in handler.get_finished()] == ["before"]
    handler.shutdown()


def test_a_host_buffer_whose_storage_is_swapped_is_refused_naming_it():
    rng = np.random.default_rng(51)
    handler, tensors, host = swappable_handler(rng)
    before = [t.clone() for t in tensors]
    replacement = torch.full_like(host, 0x5A)
    host.set_(replacement)
    for submit in (lambda: handler.store("store", GPUSpec([2, 3], [2], [0]), CPUSpec([1])),
                   lambda: handler.load("load", CPUSpec([0]), GPUSpec([0, 1], [2], [0]))):
        with pytest.raises(ValueError, match=r"host_buffer: its memory changed since it was registered"):
            submit()
    assert (replacement == 0x5A).all() and all(torch.equal(t, b) for t, b in zip(tensors, before))
    assert handler.get_finished() == []
    handler.shutdown()


@pytest.mark.parametrize("args, message", [
    (lambda a: ([[a]], 0, 2), r"num_cpu_chunks: group 0 has 0 CPU chunks and the pool no memory"),
    (lambda a: ([[a], [a]], 0, 2), r"num_cpu_chunks: group 0 has 0 CPU chunks"),
    (lambda a: ([[torch.zeros(0, 64, dtype=torch.uint8)]], 4, 2), r"gpu_tensors\[0\]\[0\]: has 0 blocks"),
    (lambda a: ([[a], [a[:0]]], 4, 2), r"gpu_tensors\[1\]\[0\]: has 0 blocks"),
])
def test_empty_pools_and_groups_name_the_count_at_fault(args, message):
    a = torch.zeros(8, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        OffloadHandler(*args(a))


class ReversedView:
    """What a reversed view (numpy's x[::-1]) shows the planner: torch makes none."""

    shape = (8, 8)

    def stride(self):
        return (-8, 1)

    def element_size(self):
        return 1


def test_a_reversed_view_is_refused_as_a_negative_stride():
    from kvoffload.pages.planner import tensor_pages

    with pytest.raises(ValueError, match=r"gpu_tensors\[0\]\[0\]: has a negative stride \(-8 in dim 0, a reversed "
                                         r"view\); blocks must run forward"):
        tensor_pages([[ReversedView()]])


def test_the_pool_of_a_live_handler_cannot_be_released_under_its_jobs():
    handler, model = small_handler()
    with pytest.raises(RuntimeError, match=r"release: the pool is held by OffloadHandler, whose jobs copy into "
                                           r"it; its shutdown\(\) releases the pool"):
        handler.pool.release()
    run_job(handler, model, "s", "store", [0, 1], [2], [0], [0])  # still mapped: the store lands in it
    check(handler, model)
    pool = handler.pool
    handler.shutdown()
    assert pool.memory is None or pool.array.size == 0  # released by shutdown()
    pool.release()  # idempotent, and no longer held


def test_an_interrupted_shutdown_leaves_the_handler_usable(monkeypatch):
    handler, model = small_handler()
    assert handler.store("s", GPUSpec([0, 1], [2], [0]), CPUSpec([0]))
    interrupt_first_wait(monkeypatch, handler)
    with pytest.raises(KeyboardInterrupt):
        handler.shutdown()
    handler.wait("s")
    assert [(r.job_id, r.success) for r in handler.get_finished()] == [("s", True)]
    model.store([0, 1], [2], [0], [0])
    run_job(handler, model, "l", "load", [4, 5], [2], [0], [0])
    check(handler, model)
    handler.shutdown()
    with pytest.raises(RuntimeError, match="the handler is shut down"):
        handler.store("t", GPUSpec([0, 1], [2], [0]), CPUSpec([0]))
