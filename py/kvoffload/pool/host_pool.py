"""The CPU pool a handler offloads into: pinned host memory (its layout:
kvoffload.pool.layout).

``HostPool`` makes the pool's memory (kvoffload.pool.memory) and pins it: threads on
the GPU's NUMA node's CPUs fault its pages in while registrars page-lock it behind them,
one registration (a cudaHostRegister) after another, each ending between chunks
(kvoffload.pool.registrations), in the foreground or in the background (``ready()``,
``wait()``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Hashable, Sequence

import numpy as np

from .. import _C

from ..copy.writable import require_writable
from ..pages.planner import TransferPlan
from ..util.arguments import is_int
from . import numa
from .memory import HUGE_PAGES, PinnedMemoryError, PoolMemory
from .registrations import ChunkRun, registration_ends, split_at
from .shm_file import check_name

MAX_THREADS = 1 << 12  # first-touch and registration threads a pool may ask for


class PoolNotReadyError(RuntimeError):
    """A job needs chunks of a pool that are not pinned yet."""


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """How a HostPool is made and pinned.

    shm_name: share the pool with other processes as this file under /dev/shm.
    huge_pages: "auto" (THP where the machine has them), "off", "thp" or "hugetlb" (see
    kvoffload.pool.memory).
    background: return at once and pin in a background thread.
    wait_for_pinning: a job needing chunks not pinned yet waits for them (True) or
    raises PoolNotReadyError (False).
    threads: first-touch threads (None: one per CPU of the NUMA node).
    numa_node: the node to place the pool on (None: the GPU's, where known).
    registration_bytes: registrations are at most this large, where chunks allow.
    register_threads: registrations made at once (pinning pages is the driver's slow part;
    a failure then stops only the registrations not started yet).
    progress_bytes: pools this large print their progress on stderr.
    """

    shm_name: str | None = None
    huge_pages: str = "auto"  # THP pins about twice as fast (docs/studies.md#pinning-the-pool)
    background: bool = False
    wait_for_pinning: bool = False
    threads: int | None = None
    numa_node: int | None = None
    registration_bytes: int = 4 << 30
    register_threads: int = 4  # faster than 1, as fast as 16 (docs/studies.md#pinning-the-pool)
    progress_bytes: int = 8 << 30

    def __post_init__(self):
        if self.shm_name is not None:
            check_name(self.shm_name)
        if self.huge_pages not in HUGE_PAGES:
            raise ValueError(f"huge_pages: expected one of {HUGE_PAGES}, got {self.huge_pages!r}")
        for field in ("background", "wait_for_pinning"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field}: expected True or False, got {getattr(self, field)!r}")
        if self.threads is not None and (not is_int(self.threads) or not 1 <= self.threads <= MAX_THREADS):
            raise ValueError(f"threads: expected None or an int in [1, {MAX_THREADS}], got {self.threads!r}")
        if self.numa_node is not None and (not is_int(self.numa_node) or self.numa_node < 0):
            raise ValueError(f"numa_node: expected None or an int >= 0, got {self.numa_node!r}")
        if not is_int(self.register_threads) or not 1 <= self.register_threads <= MAX_THREADS:
            raise ValueError(f"register_threads: expected an int in [1, {MAX_THREADS}], got {self.register_threads!r}")
        if not is_int(self.registration_bytes) or self.registration_bytes < 4096:
            raise ValueError(f"registration_bytes: expected an int >= 4096, got {self.registration_bytes!r}")
        if not is_int(self.progress_bytes) or self.progress_bytes < 0:
            raise ValueError(f"progress_bytes: expected an int >= 0, got {self.progress_bytes!r}")


class HostPool:
    """``nbytes`` of host memory for a handler: made and pinned here (see PoolOptions),
    or the caller's ``buffer`` (a contiguous CPU tensor), page-locked here if it is not.

    pinned=False (machines without a GPU) maps and touches the memory but registers
    nothing. device: the CUDA device whose NUMA node the pool goes on. chunk_runs: the
    runs no registration may end inside (``chunk_runs()``). layout: what the pool holds,
    for a shared pool (``shm_name``): attaching to a file that holds another is refused.
    ``release()`` unregisters and unmaps everything, also after a failure.
    """

    def __init__(self, nbytes: int, *, buffer=None, pinned: bool = True, device: int = 0,
                 chunk_runs: Sequence[ChunkRun] = (), options: PoolOptions | None = None, layout: str = ""):
        if not is_int(nbytes) or nbytes < 0:
            raise ValueError(f"nbytes: expected an int >= 0, got {nbytes!r}")
        self.nbytes = int(nbytes)
        self.options = options if options is not None else PoolOptions()
        self.layout = layout
        self.device = device
        self.pinned = pinned
        self._pid = os.getpid()  # a forked child's copy leaves the registrations to this process
        self.memory: PoolMemory | None = None
        self._buffer = None
        self._tensor = None
        self._registered: list[int] = []  # addresses of the registrations
        self._edges = np.zeros(0, np.int64)  # addresses where one registration ends and the next begins
        self._cond = threading.Condition()
        self._pinned_bytes = 0
        self._registrations_done: dict[int, int] = {}  # start -> end of registrations pinned past the prefix
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._holder = None  # see hold()
        self.seconds = 0.0  # spent pinning so far
        self.touch_seconds = 0.0  # of which first-touching registrations
        self.register_seconds = 0.0  # registering, summed over the registrar threads
        self._printed = 0.0  # when progress was last printed
        if buffer is not None:
            self._adopt(buffer)
        elif self.nbytes == 0:
            self.base = 0
        else:
            self._make(list(chunk_runs))

    # The pool's memory -------------------------------------------------------------------

    def _adopt(self, buffer) -> None:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("host_buffer: must be a contiguous CPU tensor")
        held = buffer.numel() * buffer.element_size()
        if held < self.nbytes:
            raise ValueError(f"host_buffer: holds {held} bytes, the layout needs {self.nbytes}")
        require_writable([("host_buffer", buffer.data_ptr(), held)])
        self._buffer = self._tensor = buffer
        self.base = buffer.data_ptr()
        if self.pinned and held and not _C.is_pinned_host(self.base):
            try:
                _C.host_register(self.base, held)
            except _C.CudaError as e:
                raise PinnedMemoryError(f"host_buffer: could not page-lock {held} bytes: {e}") from e
            self._registered.append(self.base)
        self._pinned_bytes = self.nbytes

    def _make(self, runs: list[ChunkRun]) -> None:
        opts = self.options
        host_alloc = self.pinned and not _C.pool_register_supported(self.device)
        if host_alloc:
            warnings.warn(f"device {self.device} cannot register host memory (cudaHostRegister "
                          "unsupported, as under confidential computing): allocating the pool with "
                          "cudaHostAlloc, in the foreground, on no chosen NUMA node", RuntimeWarning,
                          stacklevel=3)
        self.memory = PoolMemory(self.nbytes, opts.shm_name, opts.huge_pages,
                                 self.device if host_alloc else None, shm_tag=self.layout)
        self.base = self.memory.base
        if host_alloc:
            self._pinned_bytes = self.nbytes
            return
        try:
            node = opts.numa_node
            if node is None and self.pinned:
                node = _C.pool_numa_node(self.device)
            cpus, bind = numa.placement(node)
            ends = registration_ends(self.memory.mapped_bytes, runs, opts.registration_bytes)
            if self.pinned:
                self._edges = self.base + np.array(ends[:-1], np.int64)
        except BaseException:
            self.memory.close()
            raise
        args = (ends, cpus, bind, opts.threads or len(cpus))
        if opts.background:
            self._thread = threading.Thread(target=self._pin, args=args + (False,),
                                            name="kvoffload-host-pool", daemon=True)
            self._thread.start()
            return
        try:
            self._pin(*args, True)
        except BaseException:
            self.release()
            raise

    @property
    def array(self) -> np.ndarray:
        """The pool's bytes as a numpy array (uint8)."""
        if self._buffer is not None:
            return self._buffer.view(-1).view(self._torch().uint8).numpy()
        return self.memory.array if self.memory is not None else np.zeros(0, np.uint8)

    @property
    def tensor(self):
        """The pool's bytes as a torch tensor (uint8)."""
        if self._tensor is None:
            self._tensor = self._torch().from_numpy(self.array)
        return self._tensor

    @staticmethod
    def _torch():
        import torch

        return torch

    # Pinning --------------------------------------------------------------------------

    def _pin(self, ends: list[int], cpus: list[int], bind: int | None, threads: int,
             raise_errors: bool) -> None:
        """Touches one registration after another while registrar threads register the touched ones."""
        start, memory, broken = time.monotonic(), self.memory, threading.Event()

        def register(at: int, end: int) -> None:
            if broken.is_set() or self._stop:
                return  # registrations pin in order: none after a failed one
            try:
                self._register(at, end, start)
            except BaseException:
                broken.set()
                raise

        try:
            if bind is not None:
                _C.pool_prefer_node(self.base, memory.mapped_bytes, bind)
            with ThreadPoolExecutor(self.options.register_threads,
                                    thread_name_prefix="kvoffload-registrar") as registrar:
                registered, at = [], 0
                for end in ends:
                    if self._stop or broken.is_set():
                        break
                    self._touch(at, end, cpus, threads)
                    if self.pinned:
                        registered.append(registrar.submit(register, at, end))
                    else:
                        self._advance(at, end, start)
                    at = end
            for future in registered:
                future.result()
        except BaseException as e:
            error = e if isinstance(e, PinnedMemoryError) else PinnedMemoryError(
                f"pinning the host pool failed: {e!r}")
            if error is not e:
                error.__cause__ = e
            with self._cond:
                self._error = error
                self._cond.notify_all()
            if raise_errors:
                raise

    def _touch(self, at: int, end: int, cpus: list[int], threads: int) -> None:
        began = time.monotonic()
        try:
            _C.pool_touch(self.base + at, end - at, np.array(cpus, dtype=np.int64), threads)
            self.touch_seconds += time.monotonic() - began
        except RuntimeError as e:
            if str(e).startswith("first touch: could not start"):
                raise PinnedMemoryError(f"could not start the threads that fault the host pool "
                                        f"in: {e}") from e
            shared = self.memory.shared_file
            where = f" ({shared.path}: is its filesystem full?)" if shared is not None else ""
            raise PinnedMemoryError(f"could not allocate the host pool's memory{where}: {e}") from e

    def _register(self, at: int, end: int, start: float) -> None:
        began = time.monotonic()
        try:
            _C.pool_register(self.base + at, end - at, self.device)
        except _C.CudaError as e:
            raise PinnedMemoryError(f"could not page-lock bytes [{at}, {end}) of the "
                                    f"{self.nbytes}-byte host pool: {e}{_memlock_hint(self.nbytes)}") from e
        with self._cond:
            self._registered.append(self.base + at)
            self.register_seconds += time.monotonic() - began
        self._advance(at, end, start)

    def _advance(self, at: int, end: int, start: float) -> None:
        """Registration [at, end) is ready; the pinned prefix grows over every ready registration."""
        with self._cond:
            self._registrations_done[at] = end
            prefix = self._pinned_bytes
            while prefix in self._registrations_done:
                prefix = self._registrations_done.pop(prefix)
            self._pinned_bytes = min(prefix, self.nbytes)
            self.seconds = time.monotonic() - start
            last = self._pinned_bytes >= self.nbytes
            if self.nbytes >= self.options.progress_bytes and (last or self.seconds >= self._printed + 1):
                self._printed = self.seconds
                done = "pinned" if self.pinned else "touched"
                print(f"kvoffload: host pool {done} {self._pinned_bytes / 2**30:.1f} of "
                      f"{self.nbytes / 2**30:.1f} GiB in {self.seconds:.1f} s", file=sys.stderr, flush=True)
            self._cond.notify_all()

    @property
    def pinned_bytes(self) -> int:
        """How many bytes from the start of the pool are pinned (touched without a GPU)."""
        return self._pinned_bytes

    def ready(self) -> bool:
        """Whether the whole pool is pinned. Raises PinnedMemoryError if pinning failed."""
        self._raise_error()
        return self._pinned_bytes >= self.nbytes

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the pool is pinned (True) or ``timeout`` seconds pass (False).
        Raises PinnedMemoryError if pinning failed."""
        return self._wait_for(self.nbytes, timeout)

    def _wait_for(self, nbytes: int, timeout: float | None = None) -> bool:
        self._raise_error()
        if self._stop:
            return self._pinned_bytes >= nbytes
        if os.getpid() != self._pid and self._pinned_bytes < nbytes:  # before the lock, which a thread may hold
            raise RuntimeError(f"this pool was made in process {self._pid} and is pinned in the background "
                               f"there; in process {os.getpid()}, a child forked from it, its pinning thread "
                               "did not survive the fork and the rest of it will never be pinned")
        with self._cond:
            done = self._cond.wait_for(lambda: self._pinned_bytes >= nbytes or self._error is not None
                                       or self._stop, timeout)
        self._raise_error()
        return done and self._pinned_bytes >= nbytes

    def _raise_error(self) -> None:
        if self._error is not None:
            raise PinnedMemoryError(str(self._error)) from self._error

    def require_pinned(self, reach: int, job_id: Hashable) -> None:
        """Returns once the pool is pinned up to address ``reach`` (a job's furthest byte,
        ``chunks_reach()``): at once if it is, after waiting for it with
        ``wait_for_pinning``, else raises PoolNotReadyError."""
        reach -= self.base
        if reach <= self._pinned_bytes:
            return
        if not self.options.wait_for_pinning:
            self._raise_error()
            raise PoolNotReadyError(
                f"job {job_id!r}: needs bytes of the host pool up to {reach}, but only "
                f"{self._pinned_bytes} of {self.nbytes} are pinned yet; wait for pool.wait(), "
                "or make the pool with PoolOptions(wait_for_pinning=True)")
        if not self._wait_for(reach):
            raise PoolNotReadyError(f"job {job_id!r}: the host pool was released")

    @property
    def registration_edges(self) -> np.ndarray:
        """Addresses where one of the pool's registrations ends and the next begins."""
        return self._edges

    def split_plan(self, plan: TransferPlan) -> TransferPlan:
        """``plan`` with its copies cut where two of the pool's registrations meet."""
        cpu, gpu, sizes = split_at(self._edges, plan.cpu, plan.gpu, plan.sizes)
        if cpu is plan.cpu:
            return plan
        return dataclasses.replace(plan, gpu=gpu, cpu=cpu, sizes=sizes)

    # Release ---------------------------------------------------------------------------

    def hold(self, holder) -> None:
        """Refuses release() while ``holder`` (a handler whose jobs copy into the pool) is
        alive, until let_go()."""
        self._holder = weakref.ref(holder)

    def let_go(self) -> None:
        self._holder = None

    def release(self) -> None:
        """Stops pinning, unregisters every registration and unmaps (or frees) the memory, which
        goes now or, if views of it are still alive, with the last of them. Idempotent. In
        a forked child it only unmaps the child's copy: a shared file stays, and so does
        its lock, which is the parent's. Refused while a handler holds the pool."""
        holder = self._holder() if self._holder is not None else None
        if holder is not None:
            raise RuntimeError(f"release: the pool is held by {type(holder).__name__}, whose jobs copy "
                               "into it; its shutdown() releases the pool")
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        failures = []
        if os.getpid() != self._pid:
            self._registered = []  # the parent's, in its CUDA context: a forked child only unmaps
        for address in self._registered:
            try:
                if self._buffer is not None:
                    _C.host_unregister(address)
                else:
                    _C.pool_unregister(address, self.device)
            except _C.CudaError as e:
                failures.append(e)
        self._registered = []
        self._tensor = self._buffer = None
        if self.memory is not None:
            self.memory.close()
        if failures:
            raise PinnedMemoryError(f"release: {len(failures)} registrations of the host pool could not "
                                    f"be unregistered: {failures[0]}") from failures[0]

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - nothing can be reported from a finalizer
            pass


def _memlock_hint(nbytes: int) -> str:
    """Names RLIMIT_MEMLOCK when it is below the pool's size."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= nbytes:
        return ""
    return f" (RLIMIT_MEMLOCK is {soft} bytes, below the pool's {nbytes}: raise it, e.g. ulimit -l unlimited)"
