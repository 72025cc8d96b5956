"""kvoffload.pool.host_pool on a machine without a GPU: the pool is mapped, touched in
parallel, pinned one registration after another (CUDA's calls stood in for by FakeCuda), ready in the
background, refused to jobs until pinned, and gone without a trace on failure and on
release()."""

import os
import re
import resource
import threading
import time

import numpy as np
import pytest

from kvoffload import _C
from kvoffload.pages.planner import CPUSpec, GPUSpec, TransferPlan
from kvoffload.pool.host_pool import HostPool, PinnedMemoryError, PoolNotReadyError, PoolOptions
from kvoffload.pool.layout import chunks_reach, kv_layout
from kvoffload.pool.registrations import ChunkRun
from kv_model import check, make_handler
from proc_maps import mapping

MiB = 1 << 20


def status_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


class FakeCuda:
    """The pool's CUDA calls, recorded: registrations (failing the ``fail_at``-th),
    and cudaHostAlloc from numpy memory."""

    def __init__(self, monkeypatch, supported=True, fail_at=None):
        self.registered, self.calls, self.fail_at = {}, [], fail_at
        self.allocations, self.freed = {}, []
        for name in ("pool_register", "pool_unregister", "pool_host_alloc", "pool_free_host"):
            monkeypatch.setattr(_C, name, getattr(self, name[5:]))
        monkeypatch.setattr(_C, "pool_register_supported", lambda device: supported)
        monkeypatch.setattr(_C, "pool_numa_node", lambda device: -1)

    def register(self, address, nbytes, device):
        self.calls.append((address, nbytes))
        if len(self.calls) == self.fail_at:
            raise _C.CudaError("cudaHostRegister: cudaErrorMemoryAllocation (2): out of memory")
        assert address % 4096 == 0 and nbytes > 0
        assert all(address + nbytes <= a or a + n <= address for a, n in self.registered.items())
        self.registered[address] = nbytes

    def unregister(self, address, device):
        del self.registered[address]

    def host_alloc(self, nbytes, device):
        memory = np.zeros(nbytes + 4096, np.uint8)
        address = -(-memory.ctypes.data // 4096) * 4096
        self.allocations[address] = memory
        return address

    def free_host(self, address, device):
        self.freed.append(address)
        del self.allocations[address]


class Gate:
    """Stands in for pool_touch: lets the first ``open_registrations`` registrations through, then
    blocks until opened; ``blocked`` is set once a registration waits."""

    def __init__(self, monkeypatch, open_registrations=1, fail=False):
        self.touch, self.calls, self.open_registrations, self.fail = _C.pool_touch, 0, open_registrations, fail
        self.blocked, self.opened = threading.Event(), threading.Event()
        monkeypatch.setattr(_C, "pool_touch", self)

    def __call__(self, address, nbytes, cpus, threads):
        self.calls += 1
        if self.calls > self.open_registrations:
            self.blocked.set()
            self.opened.wait()
            if self.fail:
                raise RuntimeError("touching bytes [0, 4096) of the pool: Cannot allocate memory")
        self.touch(address, nbytes, cpus, threads)


def test_a_pool_is_resident_exactly_once_touched():
    before = status_kib("RssAnon")
    pool = HostPool(64 * MiB + 5, pinned=False, options=PoolOptions(threads=2, registration_bytes=16 * MiB))
    grown = status_kib("RssAnon") - before
    assert pool.ready() and pool.pinned_bytes == pool.nbytes
    assert 64 * 1024 + 4 <= grown <= 64 * 1024 + 1024, grown  # KiB: the pool, plus this process's noise
    assert pool.array.size == 64 * MiB + 5 and not pool.array.any()
    assert pool.tensor.data_ptr() == pool.base
    pool.release()
    assert mapping(pool.base) is None


def test_registrations_end_between_chunks_and_release_unregisters_them(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    chunk = 3 * 4096 + 4096 * 5  # 32 KiB chunks
    pool = HostPool(40 * chunk, chunk_runs=[ChunkRun(0, chunk, 40 * chunk)],
                    options=PoolOptions(registration_bytes=100 << 10))
    registrations = sorted(cuda.registered.items())
    assert registrations[0][0] == pool.base and sum(n for _, n in registrations) == pool.memory.mapped_bytes
    for (a, n), (b, _) in zip(registrations, registrations[1:]):
        assert a + n == b and (b - pool.base) % chunk == 0 and n <= 100 << 10
    pool.release()
    assert cuda.registered == {} and mapping(pool.base) is None
    pool.release()  # idempotent


def test_a_failed_registration_undoes_everything_and_names_memlock(monkeypatch):
    cuda = FakeCuda(monkeypatch, fail_at=3)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (4096, hard))
    try:
        with pytest.raises(PinnedMemoryError, match=r"could not page-lock bytes \[8388608, 12582912\) of "
                           r"the 16777216-byte host pool: cudaHostRegister: cudaErrorMemoryAllocation .*"
                           r"RLIMIT_MEMLOCK is 4096 bytes"):
            HostPool(16 * MiB, options=PoolOptions(registration_bytes=4 * MiB, register_threads=1))
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))
    assert cuda.registered == {} and mapping(cuda.calls[0][0]) is None


def test_a_failed_touch_undoes_everything_and_removes_a_shared_file(monkeypatch, tmp_path):
    cuda = FakeCuda(monkeypatch)
    gate = Gate(monkeypatch, open_registrations=2, fail=True)
    gate.opened.set()
    name = f"kvoffload-test-{tmp_path.name}"
    with pytest.raises(PinnedMemoryError, match=rf"could not allocate the host pool's memory "
                       rf"\(/dev/shm/{name}: is its filesystem full\?\): touching"):
        HostPool(16 * MiB, options=PoolOptions(registration_bytes=4 * MiB, shm_name=name, register_threads=1))
    assert len(cuda.calls) == 2 and cuda.registered == {}
    assert mapping(cuda.calls[0][0]) is None
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_background_pool_reports_readiness_and_progress(monkeypatch, capfd):
    gate = Gate(monkeypatch)
    pool = HostPool(4 * MiB, pinned=False,
                    options=PoolOptions(background=True, registration_bytes=MiB, progress_bytes=MiB))
    gate.blocked.wait()
    assert pool.pinned_bytes == MiB and not pool.ready() and not pool.wait(timeout=0)
    gate.opened.set()
    assert pool.wait() and pool.ready() and pool.pinned_bytes == 4 * MiB
    assert "kvoffload: host pool touched 0.0 of 0.0 GiB in" in capfd.readouterr().err.splitlines()[-1]
    pool.release()


def test_a_forked_child_waiting_for_a_pool_pinned_in_the_background_is_told_it_never_will(monkeypatch):
    gate = Gate(monkeypatch)
    pool = HostPool(4 * MiB, pinned=False, options=PoolOptions(background=True, registration_bytes=MiB))
    gate.blocked.wait()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            try:
                outcome = f"returned {pool.wait(timeout=30)!r}"
            except RuntimeError as e:
                outcome = str(e)
            os.write(write, outcome.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        outcome = f.read().decode()
    os.waitpid(pid, 0)
    assert re.fullmatch(rf"this pool was made in process {os.getpid()} and is pinned in the background there; in "
                        r"process \d+, a child forked from it, its pinning thread did not survive the fork and "
                        "the rest of it will never be pinned", outcome), outcome
    gate.opened.set()
    assert pool.wait() and pool.ready()  # the parent's pinning went on
    pool.release()


def test_small_pools_print_no_progress(capfd):
    HostPool(MiB, pinned=False).release()
    assert capfd.readouterr().err == ""


def test_a_background_failure_is_raised_by_ready_and_wait_and_release_cleans_up(monkeypatch):
    cuda = FakeCuda(monkeypatch, fail_at=2)
    pool = HostPool(4 * MiB, options=PoolOptions(background=True, registration_bytes=MiB, register_threads=1))
    with pytest.raises(PinnedMemoryError, match=r"could not page-lock bytes \[1048576, 2097152\)"):
        pool.wait()
    with pytest.raises(PinnedMemoryError, match="could not page-lock"):
        pool.ready()
    assert pool.pinned_bytes == MiB and len(cuda.registered) == 1  # the first registration stays usable
    pool.release()
    assert cuda.registered == {} and mapping(pool.base) is None


def test_release_while_pinning_in_the_background(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    gate = Gate(monkeypatch)
    pool = HostPool(8 * MiB, options=PoolOptions(background=True, registration_bytes=MiB, register_threads=1))
    gate.blocked.wait()
    gate.opened.set()
    pool.release()
    assert cuda.registered == {} and mapping(pool.base) is None


def plan(cpu, sizes):
    cpu, sizes = np.array(cpu, np.int64), np.array(sizes, np.int64)
    return TransferPlan(cpu + (1 << 40), cpu, sizes, int(sizes.sum()))


def test_jobs_are_refused_until_their_chunks_are_pinned(monkeypatch):
    gate = Gate(monkeypatch)
    pool = HostPool(4 * MiB, pinned=False, options=PoolOptions(background=True, registration_bytes=MiB))
    gate.blocked.wait()
    pool.require_pinned(pool.base + MiB, "in")
    with pytest.raises(PoolNotReadyError, match=r"job 'late': needs bytes of the host pool up to "
                       r"1052672, but only 1048576 of 4194304 are pinned yet"):
        pool.require_pinned(pool.base + MiB + 4096, "late")
    gate.opened.set()
    pool.wait()
    pool.require_pinned(pool.base + MiB + 4096, "late")
    pool.release()


class SignallingCondition(threading.Condition):
    """A Condition that sets ``event`` whenever someone waits on it."""

    def __init__(self, event):
        super().__init__()
        self.event = event

    def wait(self, timeout=None):
        self.event.set()
        return super().wait(timeout)


def test_with_wait_for_pinning_a_job_waits_for_its_chunks(monkeypatch):
    gate = Gate(monkeypatch)
    pool = HostPool(4 * MiB, pinned=False,
                    options=PoolOptions(background=True, registration_bytes=MiB, wait_for_pinning=True))
    gate.blocked.wait()
    pool._cond = SignallingCondition(gate.opened)  # the gate opens once the job waits
    pool.require_pinned(pool.base + 3 * MiB + 4096, "late")
    assert pool.pinned_bytes >= 3 * MiB + 4096
    pool.release()


def test_copies_are_cut_where_registrations_meet(monkeypatch):
    FakeCuda(monkeypatch)
    pool = HostPool(64 << 10, options=PoolOptions(registration_bytes=16 << 10))
    whole = plan([pool.base + 4096, pool.base + (40 << 10)], [32 << 10, 4096])
    cut = pool.split_plan(whole)
    assert (cut.cpu - pool.base).tolist() == [4096, 16 << 10, 32 << 10, 40 << 10]
    assert cut.sizes.tolist() == [12 << 10, 16 << 10, 4096, 4096]
    assert (cut.gpu - cut.cpu == 1 << 40).all() and cut.total_bytes == whole.total_bytes
    inside = plan([pool.base], [16 << 10])
    assert pool.split_plan(inside) is inside
    pool.release()


@pytest.mark.parametrize("cpu_layout", ["chunk_major", "per_tensor"])
def test_a_jobs_reach_is_the_end_of_its_furthest_chunk(cpu_layout):
    import torch

    gpu = [[torch.zeros(4, 100, dtype=torch.uint8), torch.zeros(4, 300, dtype=torch.uint8)],
           [torch.zeros(4, 64, dtype=torch.uint8)]]
    layout = kv_layout(gpu, [[100, 300], [64]], [5, 3], 2, 1 << 20, cpu_layout)
    assert chunks_reach(layout, np.array([4, 2]), [1, 1]) == (1 << 20) + 4096 + 3 * 128
    assert chunks_reach(layout, np.array([0, 1, 0]), [2, 1]) == (1 << 20) + 4096 + 128
    assert chunks_reach(layout, np.array([1]), [1, 0]) == (1 << 20) + (1600 if cpu_layout == "chunk_major" else 2200)


def test_without_registration_the_pool_comes_from_cuda_host_alloc(monkeypatch):
    cuda = FakeCuda(monkeypatch, supported=False)
    with pytest.warns(RuntimeWarning, match=r"device 0 cannot register host memory .* cudaHostAlloc"):
        pool = HostPool(10000)
    assert pool.ready() and pool.base in cuda.allocations and cuda.registered == {}
    pool.array[:] = 1
    view = pool.tensor[:5]
    pool.release()
    assert cuda.freed == []  # a view is alive
    del view
    assert cuda.freed == [pool.base]
    with pytest.warns(RuntimeWarning), pytest.raises(PinnedMemoryError, match="shm_name: a shared pool "
                                                     "needs cudaHostRegister"):
        HostPool(10000, options=PoolOptions(shm_name="x"))


@pytest.mark.parametrize("options, message", [
    (dict(threads=0), r"threads: expected None or an int in \[1, 4096\], got 0"),
    (dict(threads=1 << 40), r"threads: expected None or an int in \[1, 4096\], got 1099511627776"),
    (dict(register_threads=1 << 40), r"register_threads: expected an int in \[1, 4096\], got 1099511627776"),
    (dict(numa_node=-1), r"numa_node: expected None or an int >= 0, got -1"),
    (dict(registration_bytes=100), r"registration_bytes: expected an int >= 4096, got 100"),
    (dict(huge_pages="yes"), r"huge_pages: expected one of"),
    (dict(background="no"), r"background: expected True or False, got 'no'"),
    (dict(wait_for_pinning="no"), r"wait_for_pinning: expected True or False, got 'no'"),
    (dict(background=1), r"background: expected True or False, got 1"),
    (dict(threads=True), r"threads: expected None or an int in \[1, 4096\], got True"),
    (dict(numa_node=False), r"numa_node: expected None or an int >= 0, got False"),
    (dict(registration_bytes=True), r"registration_bytes: expected an int >= 4096, got True"),
    (dict(progress_bytes="8G"), r"progress_bytes: expected an int >= 0, got '8G'"),
    (dict(progress_bytes=-1), r"progress_bytes: expected an int >= 0, got -1"),
    (dict(progress_bytes=None), r"progress_bytes: expected an int >= 0, got None"),
    (dict(shm_name="a\0b"), r"shm_name: must not contain a NUL byte"),
    (dict(shm_name=""), r"shm_name: expected a file name without '/'"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        PoolOptions(**options)


def test_bad_sizes_and_nodes_are_named_and_leave_nothing_mapped():
    with pytest.raises(ValueError, match=r"nbytes: expected an int >= 0, got -1"):
        HostPool(-1, pinned=False)
    before = status_kib("VmSize")
    with pytest.raises(ValueError, match=r"numa_node: node 999 has no memory"):
        HostPool(1 << 30, pinned=False, options=PoolOptions(numa_node=999))
    assert status_kib("VmSize") - before < (512 << 10)


def test_the_handler_refuses_jobs_on_chunks_not_yet_pinned(monkeypatch):
    gate = Gate(monkeypatch)
    rng = np.random.default_rng(0)
    # One 64 KiB chunk per registration: chunk c is registration c.
    handler, model = make_handler(rng, [64 << 10], [1], num_blocks=8, num_chunks=8, bpc=1,
                                  cpu_layout="chunk_major",
                                  host_pool=PoolOptions(background=True, registration_bytes=64 << 10))
    gate.blocked.wait()
    assert handler.store("first", GPUSpec([3], [1], [0]), CPUSpec([0]))
    with pytest.raises(PoolNotReadyError, match="job 'second': needs bytes of the host pool"):
        handler.store("second", GPUSpec([4], [1], [0]), CPUSpec([5]))
    model.store([3], [1], [0], [0])
    gate.opened.set()
    handler.pool.wait()
    assert handler.store("second", GPUSpec([4], [1], [0]), CPUSpec([5]))
    model.store([4], [1], [0], [5])
    handler.wait(["first", "second"])
    check(handler, model)
    handler.shutdown()
    assert mapping(handler.pool.base) is None


def test_registrations_done_at_once_grow_the_pinned_prefix_only(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    rng = np.random.default_rng(3)
    delays = iter(rng.uniform(0, 0.02, 64))
    register = cuda.register

    def slow_register(address, nbytes, device):
        time.sleep(next(delays))  # registrations finish out of order
        register(address, nbytes, device)

    monkeypatch.setattr(_C, "pool_register", slow_register)
    pool = HostPool(32 * MiB + 5, options=PoolOptions(background=True, registration_bytes=MiB, register_threads=4))
    seen = set()
    while not pool.ready():
        pinned = pool.pinned_bytes
        registered = dict(cuda.registered)  # a snapshot taken after pinned_bytes was read
        at = pool.base
        while at < pool.base + pinned:
            assert at in registered, f"pinned_bytes {pinned} claims an unregistered registration at {at - pool.base}"
            at += registered[at]
        seen.add(pinned)
        time.sleep(0.001)
    assert pool.pinned_bytes == 32 * MiB + 5 and len(cuda.registered) == 33
    assert len(seen) > 3  # readiness was watched growing
    pool.release()
    assert cuda.registered == {}


def test_register_threads_must_be_a_positive_int():
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match=r"register_threads: expected an int in \[1, 4096\]"):
            PoolOptions(register_threads=bad)


# In a child whose threads get 64 MiB stacks: an address-space limit leaves room for two
# of the eight first-touch threads of a 512 MiB range.
_THREADS_CANNOT_START = """
import json, mmap, re, resource
import numpy as np
from kvoffload import _C
from kvoffload.pool.host_pool import HostPool, PinnedMemoryError, PoolOptions

def vm_bytes():
    return int(re.search(r"^VmSize:\\s+(\\d+) kB", open("/proc/self/status").read(), re.M).group(1)) << 10

def rss_kib(address):
    found = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            found = start <= address < end
        elif found and head[0] == "Rss:":
            return int(head[1])

out, soft, hard = {}, *resource.getrlimit(resource.RLIMIT_AS)
memory = mmap.mmap(-1, 512 << 20, flags=mmap.MAP_PRIVATE)
base = np.frombuffer(memory, np.uint8).ctypes.data
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (160 << 20), hard))
try:
    _C.pool_touch(base, 512 << 20, np.zeros(0, np.int64), 8)
    out["raised"] = None
except RuntimeError as e:
    out["raised"] = str(e)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
out["rss_kib"] = rss_kib(base)
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (512 << 20) + (32 << 20), hard))
try:
    HostPool(512 << 20, pinned=False, options=PoolOptions(threads=8))
    out["pool"] = None
except PinnedMemoryError as e:
    out["pool"] = str(e)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
print(json.dumps(out))
"""


def _big_thread_stacks():
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (64 * MiB, hard))


def test_first_touch_threads_that_cannot_start_raise_and_touch_nothing():
    import json
    import subprocess
    import sys

    if resource.getrlimit(resource.RLIMIT_STACK)[1] not in (resource.RLIM_INFINITY,) and \
            resource.getrlimit(resource.RLIMIT_STACK)[1] < 64 * MiB:
        pytest.skip("RLIMIT_STACK's hard limit is below 64 MiB")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run([sys.executable, "-c", _THREADS_CANNOT_START], capture_output=True, text=True,
                           env=env, preexec_fn=_big_thread_stacks, timeout=120)
    assert child.returncode == 0, child.stderr  # not std::terminate's SIGABRT
    out = json.loads(child.stdout)
    assert re.fullmatch(r"first touch: could not start thread [1-8] of 8 \(RLIMIT_AS or RLIMIT_NPROC\?\); "
                        r"nothing was touched: .+", out["raised"]), out
    assert out["rss_kib"] == 0  # the threads that started touched nothing either
    assert out["pool"].startswith("could not start the threads that fault the host pool in: first touch: "
                                  "could not start thread"), out
