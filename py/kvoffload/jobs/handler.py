"""Asynchronous KV-cache transfer jobs: store (GPU -> CPU) and load (CPU -> GPU).

The handler owns the GPU tensors of every KV-cache group and a CPU pool beside them
(see kvoffload.pool.layout for its layouts), one lane per direction and, optionally, an
expedited lane for urgent loads. Its verbs are vLLM's offload worker's: ``store`` and
``load`` (vLLM's submit_store and submit_load), ``get_finished``, ``wait``, ``shutdown``.

Safety by construction:
- every job starts after the work queued so far on the compute stream (the current
  stream at submission): a store reads finished blocks, a load overwrites idle ones;
- a job waits for every job in flight on another lane that touches the same GPU blocks
  or CPU chunks, where either writes them;
- a load reads its chunks with ANY only when no store in flight writes any of them;
  otherwise it waits for that store and reads in stream order (kvoffload.copy.ordering). So
  the pool is the handler's to write: other writes to it (the host's) are done before a
  load of those chunks is submitted, never queued on a stream;
- jobs of one lane run in submission order;
- every copy of every job lies inside the GPU tensors or the pool (``registry``),
  checked before the job is submitted.

Failures: a job whose copying fails (a CUDA error part way) is reported failed once the
copies it enqueued are done; other jobs and the handler go on. The CPU sub-blocks a
failed store wrote are marked partial: a load of any of them fails, without copying,
until a store rewrites them; no other job fails because of it. The GPU blocks of a
failed load are the caller's to recompute.
Without a GPU (CPU tensors) the same jobs run on host threads with the host copy path.

Threads: every public method may be called from any thread. Jobs are bookkept under one
lock; ``wait`` and ``shutdown`` block without holding it, and results are collected
from the oldest job of each lane only, so an interrupt (KeyboardInterrupt) leaves the
handler usable.

Statement order is a contract in this file. tests/jobs/handler_test.py raises a
KeyboardInterrupt at every line a job's calls run here and in the lanes, methods,
conflicts and accesses, and the handler must stay usable after each. So ``_submit``
bookkeeps a job (in flight, on its lane, recorded for later jobs) before it starts it,
``_unstarted`` holds the job across that gap, and every public method first finishes such
a job (``_start_unstarted``), each step of that idempotent; a job's copy goes back to its
method when the job is collected, or at once if its lane never got it. Moving a statement
across those steps is what the test exists to catch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import os
import threading
import weakref
from typing import Hashable, Iterable, Sequence

import numpy as np

from ..copy.batch_copy import load_kernels
from ..copy.registry import MemoryRegistry
from ..pages.planner import CPUSpec, GPUSpec, check_shared, group_chunks, tensor_pages
from ..pages.table import ChunkParts, job_arguments, job_names, key_offsets, page_table
from ..pool.host_pool import PoolOptions
from ..pool.layout import chunks_reach
from ..util.arguments import require_int
from ..util.vocabulary import Direction
from . import construction
from .accesses import LazyKeys
from .conflicts import LaneConflicts
from .lanes import CudaLanes, HostLanes, Lanes
from .methods import JobCopy, Method, cpu_layout_for, job_method, method_object, page_choice

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TransferResult:
    job_id: Hashable
    success: bool
    direction: Direction
    bytes: int
    # From its start (its waits met, and the lane's job before it done) to its last byte:
    # CUDA events (a host timer without a GPU).
    seconds: float
    error: str | None = None


@dataclasses.dataclass
class _Job:
    job_id: Hashable
    direction: Direction
    lane: str
    bytes: int
    keys: LazyKeys | None  # flat GPU block and CPU part numbers (pages.table.key_offsets), until started
    copy: JobCopy | None = None  # what it runs; its method's to release once retired
    handle: object = None
    seq: int = 0  # submission number

    @property
    def writes_cpu(self) -> bool:
        return self.direction is Direction.STORE


def _job_keys(table, gpu_offset, cpu_offset, parts, prepared, group_sizes):
    """A job's (gpu, cpu) keys. A function, not a method: LaneAccesses keeps it until the
    job retires, and a reference to the handler would keep a dropped handler's pool."""
    gpu_keys, cpu_keys = table.keys(prepared, gpu_offset, cpu_offset)
    return gpu_keys, parts.keys(cpu_keys, group_sizes, cpu_offset)


def _check_specs(gpu, cpu) -> None:
    if not isinstance(gpu, GPUSpec):
        raise TypeError(f"gpu: expected a GPUSpec, got {type(gpu).__name__}")
    if not isinstance(cpu, CPUSpec):
        raise TypeError(f"cpu: expected a CPUSpec, got {type(cpu).__name__}")


def _one_id(job_ids) -> bool:
    """A string, tuple or frozenset is one job id, as is anything not iterable; lists,
    sets and other iterables are several."""
    return isinstance(job_ids, (str, bytes, tuple, frozenset)) or not isinstance(job_ids, Iterable)


def _check_job_id(job_id) -> None:
    """A job id names one job in wait() and get_finished(): hashable, and equal to itself."""
    try:
        hash(job_id)
    except TypeError:
        raise TypeError(f"job_id: must be hashable, got a {type(job_id).__name__}") from None
    if isinstance(job_id, (float, np.floating)) and math.isnan(job_id):
        raise ValueError("job_id: NaN names no job (it equals nothing, itself included)")


def _checked(registry, copy, **stream):
    """A job's copy, its tensors checked again where its lane starts it (on a GPU: where
    it is enqueued): one resized or swapped while the job waited there must not be written."""
    registry.check_tensors()
    copy(**stream)


def _close_quietly(lanes) -> None:
    """A dropped handler's finalizer: its lanes end before its pool can go. A Ctrl-C during
    the join is held until they have (else the pool is unmapped under a running copy, and
    at exit a joinable thread aborts the process), then raised."""
    interrupted = None
    while True:
        try:
            lanes.close()
            break
        except KeyboardInterrupt as e:
            interrupted = e
        except Exception:  # noqa: BLE001 - at exit CUDA may be gone; nothing is left to report to
            break
    if interrupted is not None:
        raise interrupted


class OffloadHandler:
    """Runs store and load jobs between GPU KV-cache tensors and a CPU pool.

    gpu_tensors[g][t]: tensor t of group g, blocks along dim 0, each block contiguous;
    a group's tensors share the block count. num_cpu_chunks: chunks per group (an int
    for all groups); one tensor may appear in several groups (hybrid models), which then
    share its blocks and its CPU region. page_bytes[g]: bytes moved per block of group
    g's tensors, an int or one per tensor (default: the whole block). host_buffer: a CPU
    tensor to use (and page-lock) as the pool instead of allocating one; ``pool_bytes``
    says how large it must be. cpu_layout: how the pool places the chunks
    (kvoffload.pool.layout); None: "per_tensor" where the page jobs go by DMA both ways
    and the pool is the handler's own (no host_buffer, no shm_name, not pinned in the
    background), else "chunk_major" (kvoffload.jobs.methods.cpu_layout_for). cpu_places[g][t]: (offset, stride) of tensor t's chunks in
    host_buffer, for a pool laid out by someone else (kvoffload.pool.layout), in place of
    cpu_layout. host_pool: how the pool is made and pinned otherwise
    (kvoffload.pool.host_pool.PoolOptions: shared, huge pages, in the background). method:
    how jobs copy on a GPU, a name or an object with its own options
    (kvoffload.jobs.methods). The page methods (``Pages(path, ctas)``) send each job as
    ids (kvoffload.pages.table): "pages" (the default) chooses per direction from the
    layout (kvoffload.pages.paths; ``methods`` says what it chose), "pages_dma" sends
    every page by the driver's batch copy, "pages_staged" moves host runs by DMA through
    a staging ring and scatters or gathers the HBM side with a kernel, "pages_kernel" has
    that kernel reach the pool itself. "auto" (``Auto(max_slowdown)``), "batch",
    "per_copy", "kernel", "staged", "kernel_ctas2" and "kernel_ctas4" (or a
    kvoffload.copy.methods object) plan every page on the host and copy raw pointers;
    "auto" picks among the others the fastest that slows a model beside it by at most
    ``max_slowdown`` (kvoffload.costs.auto). With "auto", a device without a cached calibration
    is measured here (kvoffload.costs.calibration), taking a few minutes and 1.5 GiB each of
    pinned and device memory for the while; with ``Pages(max_slowdown=x)``, its page
    calibration (kvoffload.costs.page_calibration: about three minutes, 1.5 GiB each of pinned
    and device memory).
    """

    COLLECTED_IDS_KEPT = 1 << 14  # see wait()

    def __init__(self, gpu_tensors: Sequence[Sequence], num_cpu_chunks: int | Sequence[int],
                 blocks_per_chunk: int, *, page_bytes: Sequence[int] | None = None,
                 cpu_layout: str | None = None, host_buffer=None, cpu_places=None,
                 expedited_loads: bool = False, method: Method = "pages",
                 host_pool: PoolOptions | None = None):
        import torch

        gpu_tensors = construction.tensor_groups(torch, gpu_tensors)
        blocks_per_chunk = require_int("blocks_per_chunk", blocks_per_chunk, 1)
        device = construction.one_device(gpu_tensors)
        num_cpu_chunks = construction.chunks_per_group(num_cpu_chunks, len(gpu_tensors))
        construction.check_options(torch, host_buffer, host_pool, expedited_loads, cpu_layout, cpu_places)
        pages = tensor_pages(gpu_tensors, page_bytes)
        method = method_object(method)
        choice = page_choice(method, device, pages, gpu_tensors)
        if cpu_layout is None and cpu_places is None:
            own_pool = host_buffer is None and (host_pool is None or not (host_pool.shm_name or host_pool.background))
            cpu_layout = cpu_layout_for(choice, own_pool)
        elif choice is not None and choice.by_rows and cpu_layout != "chunk_major":
            choice = choice.without_rows(method, pages)  # 2D copies need a block's rows back to back
        self.cpu_layout = cpu_layout if cpu_places is None else None  # None: the caller's cpu_places

        on_gpu = device.type == "cuda"
        if on_gpu:
            load_kernels(device.index)  # now, so that the first job does not wait for the model
        self.registry = MemoryRegistry()
        construction.register_gpu_tensors(self.registry, gpu_tensors)
        self.pool, self.layout = construction.pool_and_layout(self.registry, gpu_tensors, pages, num_cpu_chunks,
                                                  blocks_per_chunk, cpu_layout, host_buffer, cpu_places,
                                                  host_pool, device)
        self.gpu_tensors = gpu_tensors
        lanes = [Direction.STORE.value, Direction.LOAD.value] + (["expedited"] if expedited_loads else [])
        try:
            # Checks every job's ids and keys it; for page methods also copies.
            self._table = page_table(self.layout, self.pool.registration_edges)
            self._jobs = job_method(method, device, self.layout, self._table, self.pool, self.registry, choice)
            self._lanes: Lanes = CudaLanes(torch, device, lanes) if on_gpu else HostLanes(lanes)
        except BaseException:
            self.pool.release()  # now, not when the collector finds it
            raise
        self.pool.hold(self)
        # A handler dropped without shutdown() ends its lanes before its pool goes.
        weakref.finalize(self, _close_quietly, self._lanes)
        self._expedited = expedited_loads
        self._lock = threading.RLock()
        self._in_flight: dict[Hashable, _Job] = {}
        self._lane_jobs = {lane: collections.deque() for lane in lanes}  # in flight, oldest first
        # CPU keys name parts of chunks: sub-blocks, or less where groups share CPU tensors.
        self._parts = ChunkParts.of(self.layout)
        self._gpu_offset, self._cpu_offset, gpu_keys, cpu_keys = key_offsets(self.layout, self._parts)
        # Which jobs each job waits for. Page jobs (which need no copy order) find them on
        # the lanes' enqueue threads; other jobs here.
        self._conflicts = LaneConflicts(gpu_keys, cpu_keys, self._lanes.done)
        self._unstarted: _Job | None = None  # see _start_unstarted
        self._submitted = 0
        # The ids get_finished() reported last, oldest first (at most COLLECTED_IDS_KEPT), for
        # wait(): with those in flight and those not yet collected, all the ids it knows.
        self._collected: collections.OrderedDict = collections.OrderedDict()
        self._pid = os.getpid()  # see _check_process
        self._finished: dict[Hashable, TransferResult] = {}  # not yet collected
        self._closing = self._closed = False

    def store(self, job_id: Hashable, gpu: GPUSpec, cpu: CPUSpec) -> bool:
        """Submits a job copying the GPU blocks ``gpu`` to the CPU chunks ``cpu`` and
        returns at once: True if submitted, False if it failed at once (get_finished()
        reports it). Raises before submitting anything on a job id in flight or not yet
        collected, specs that do not fit the layout or copies outside the registered
        memory, or after shutdown."""
        _check_specs(gpu, cpu)
        return self._transfer(job_id, Direction.STORE, gpu, cpu, False)

    def load(self, job_id: Hashable, cpu: CPUSpec, gpu: GPUSpec, expedite: bool = False) -> bool:
        """Submits a job copying the CPU chunks ``cpu`` to the GPU blocks ``gpu``, as
        store() does; ``expedite`` puts it on the expedited lane (expedited_loads=True).
        False: it failed at once (a load of partial chunks)."""
        _check_specs(gpu, cpu)
        if not isinstance(expedite, bool):
            raise TypeError(f"expedite: expected True or False, got {expedite!r}")
        return self._transfer(job_id, Direction.LOAD, gpu, cpu, expedite)

    def check(self, gpu: GPUSpec, cpu: CPUSpec) -> None:
        """Raises what store() or load() would for these specs, and submits nothing."""
        _check_specs(gpu, cpu)
        self._table.check(*job_arguments(gpu, cpu), names=job_names(gpu, cpu))
        check_shared(self.layout, gpu, cpu)

    def _transfer(self, job_id: Hashable, direction: Direction, gpu: GPUSpec, cpu: CPUSpec,
                  expedite: bool) -> bool:
        self._check_process()
        _check_job_id(job_id)
        self._lanes.require_not_capturing()
        used = group_chunks(gpu, self.layout.blocks_per_chunk)  # the job's chunk reach, computed once
        self._wait_for_pinning(gpu, cpu, used, job_id)  # before the lock: other threads' calls go on
        with self._lock:
            self._start_unstarted()
            self._check_open()
            if job_id in self._in_flight or job_id in self._finished:
                raise ValueError(f"job_id: {job_id!r} is already in use")
            if expedite and (direction is Direction.STORE or not self._expedited):
                raise ValueError("expedite: only for loads, on a handler made with expedited_loads=True")
            ids = job_arguments(gpu, cpu)
            # Checks the ids (the page methods' only check, besides shared tensors).
            prepared = self._table.prepare(*ids, names=job_names(gpu, cpu))
            check_shared(self.layout, gpu, cpu, used)
            nbytes, plan = self._jobs.plan(direction, prepared, gpu, self.registry)
            self.pool.require_pinned(chunks_reach(self.layout, cpu.chunk_ids, used), job_id)
            job = _Job(job_id, direction, "expedited" if expedite else direction.value, nbytes,
                       LazyKeys(functools.partial(_job_keys, self._table, self._gpu_offset, self._cpu_offset,
                                                 self._parts, prepared, gpu.group_sizes)))
            self._collect()
            return self._submit(job, plan, prepared)

    def _wait_for_pinning(self, gpu: GPUSpec, cpu: CPUSpec, used: list[int], job_id: Hashable) -> None:
        """With PoolOptions(wait_for_pinning=True), waits until the pool is pinned as far
        as the job's chunks reach, without the lock: a wait of seconds must not hold up
        get_finished(), wait() or shutdown() on other threads. Chunk ids out of range (or
        any other fault) wait for nothing here: the submission, under the lock, checks
        again (then at once) and reports what is wrong."""
        pool, layout = self.pool, self.layout
        if not pool.options.wait_for_pinning or pool.pinned_bytes >= pool.nbytes:
            return
        if len(gpu.group_sizes) != len(layout.groups):
            return
        if sum(used) != len(cpu.chunk_ids):
            return
        at = 0
        for group, n in zip(layout.groups, used):
            ids = cpu.chunk_ids[at:at + n]
            if n and (ids.min() < 0 or ids.max() >= group.num_cpu_chunks):
                return
            at += n
        try:
            pool.require_pinned(chunks_reach(layout, cpu.chunk_ids, used), job_id)
        except Exception:  # noqa: BLE001 - reported by the submission's own check
            pass

    def _submit(self, job: _Job, plan, prepared) -> bool:
        failed = self._conflicts.failed_store(Direction.STORE.value, job.keys) \
            if job.direction is Direction.LOAD else None
        if failed is not None:
            self._finished[job.job_id] = TransferResult(
                job.job_id, False, job.direction, job.bytes, 0.0,
                f"reads CPU chunks left partial by failed store {failed[0]!r}; nothing copied")
            return False
        seq = self._submitted + 1
        on_lane = self._jobs.resolves_on_lane  # see self._conflicts
        waits, sources = ([], []) if on_lane else self._conflicts.resolve(job.lane, job.writes_cpu, job.keys)
        resolve = functools.partial(self._conflicts.resolve_and_add, job.lane, seq, job.writes_cpu,
                                    job.keys) if on_lane else None
        copy = self._jobs.copy(job, prepared, plan, sources, resolve, self._lanes.done)
        try:
            job.handle = self._lanes.make(job.lane, functools.partial(_checked, self.registry, copy.copy), waits,
                                          failing_with=sources,
                                          pipelined=copy.pipelined, resolve=copy.resolve)
        except BaseException:  # nothing runs
            self._jobs.release(copy)
            raise
        job.copy = copy
        job.seq = self._submitted = seq
        # Bookkept before it can run, so later jobs see it. An interrupt that stops it
        # from being started leaves it in _unstarted, for the next call to start.
        self._unstarted = job
        self._in_flight[job.job_id] = job
        self._lane_jobs[job.lane].append(job)
        self._record(job)
        self._lanes.start(job.handle)
        self._unstarted = None
        job.keys = None  # LaneAccesses holds them until written or dropped
        return True

    def _start_unstarted(self) -> None:
        """Finishes the bookkeeping of a job an interrupt stopped in _submit and starts
        it (each step is idempotent; a job started twice runs once). Every public method
        calls this first, under the lock, so no other job came in between."""
        job = self._unstarted
        if job is None:
            return
        if job.job_id in self._in_flight:  # else it was interrupted before it existed
            lane = self._lane_jobs[job.lane]
            if not lane or lane[-1] is not job:
                lane.append(job)
            self._record(job)
            self._lanes.start(job.handle)
        self._unstarted = None
        job.keys = None

    def _record(self, job: _Job) -> None:
        """Notes a job about to start, where later jobs will look for it (idempotent)."""
        self._conflicts.submitted(job.lane, job.seq, job.keys)
        if not self._jobs.resolves_on_lane:  # else its resolve adds it, on its lane's enqueue thread
            self._conflicts.add(job.lane, job.seq, job.writes_cpu, job.keys, job.handle)

    def get_finished(self) -> list[TransferResult]:
        """The jobs that completed since the last call, without blocking."""
        self._check_process()
        with self._lock:
            self._start_unstarted()
            self._collect()
            # Noted first, so that an interrupt here loses no result; an id used again
            # moves to the end. No loop over the results: each call's lines stay few.
            collected = self._collected
            for job_id in collected.keys() & self._finished.keys():
                del collected[job_id]
            collected.update(dict.fromkeys(self._finished))
            while len(collected) > self.COLLECTED_IDS_KEPT:
                collected.popitem(last=False)
            finished, self._finished = self._finished, {}
        return list(finished.values())

    def wait(self, job_ids: Hashable | Iterable[Hashable], *, ignore_unknown: bool = False) -> None:
        """Blocks until these jobs are done: one job id (a string, tuple or frozenset is one id), or
        a list or set of them. Jobs already done return at once: those not yet collected,
        and those among the last ``COLLECTED_IDS_KEPT`` that get_finished() reported (the
        handler keeps no more, so that its memory does not grow with the jobs run). Any
        other id (never submitted, or reported long before) raises ValueError, or with
        ``ignore_unknown`` returns at once, as vLLM's offloading workers do."""
        self._check_process()
        try:
            ids = [job_ids] if _one_id(job_ids) else list(job_ids)
            for job_id in ids:
                hash(job_id)
        except TypeError as e:
            raise TypeError(f"job_ids: expected a job id or an iterable of job ids: {e}") from None
        with self._lock:
            self._start_unstarted()
            if self._closed:  # while shutdown() runs, its jobs may still be waited for
                raise RuntimeError("the handler is shut down")
            unknown = [] if ignore_unknown else [
                job_id for job_id in ids
                if job_id not in self._in_flight and job_id not in self._finished and job_id not in self._collected]
            if unknown:
                raise ValueError(f"job_ids: {unknown[0]!r} was never submitted (or was reported by "
                                 f"get_finished() before the last {self.COLLECTED_IDS_KEPT} jobs it reported)")
            handles = [self._in_flight[job_id].handle for job_id in ids if job_id in self._in_flight]
        for handle in handles:
            self._lanes.wait(handle)

    def fence(self, stream=None) -> None:
        """On a GPU: ``stream`` (default: the current stream) waits for every job
        submitted so far. The host waits only until those jobs are enqueued."""
        self._check_process()
        with self._lock:
            self._start_unstarted()
            self._check_open()
            self._lanes.fence(stream)

    def shutdown(self) -> None:
        """Waits for every job, then releases the lanes and the pool."""
        self._check_process()
        with self._lock:
            self._start_unstarted()
            if self._closed:
                return
            self._closing = True
            handles = [job.handle for job in self._in_flight.values()]
        try:
            for handle in handles:
                self._lanes.wait(handle)
        except BaseException:  # interrupted: the handler stays usable, and shutdown() can run again
            with self._lock:
                self._closing = False
            raise
        with self._lock:
            if self._closed:
                return
            self._collect()
            self._lanes.close()
            # The registry never vouches for memory given back: a copy checked against it
            # could land in whatever is mapped there next.
            if "host pool" in {r.name for r in self.registry.regions}:
                self.registry.unregister("host pool")
            self.pool.let_go()
            self.pool.release()
            self._closed = True

    @property
    def shut_down(self) -> bool:
        """Whether shutdown() has finished."""
        return self._closed

    @property
    def methods(self) -> dict[str, str]:
        """The method each direction's jobs take, by direction ("store", "load")."""
        return self._jobs.methods

    @property
    def method_reasons(self) -> dict[str, str]:
        """Why each direction's jobs take their method, and for DMA which groups go as 2D
        copies, a row per tensor, and why the others do not."""
        return self._jobs.reasons

    @property
    def descriptor_arrays_allocated(self) -> int:
        return self._jobs.descriptor_arrays_allocated

    def _collect(self) -> None:
        """Retires the finished jobs: a lane's jobs finish in order, so only each lane's
        oldest is asked. A job's failure and result are noted before it leaves its lane's
        queue (again, harmlessly, after an interrupt), so none is lost or retired twice."""
        for jobs in self._lane_jobs.values():
            while jobs and self._lanes.done(jobs[0].handle):
                job = jobs[0]
                seconds, error = self._lanes.result(job.handle)
                self._conflicts.collected(job.lane, job.seq, job.job_id, error is not None, job.writes_cpu)
                self._finished[job.job_id] = TransferResult(
                    job.job_id, error is None, job.direction, job.bytes, seconds, error)
                jobs.popleft()
                self._in_flight.pop(job.job_id, None)
                self._lanes.recycle(job.handle)
                if job.copy is not None:
                    self._jobs.release(job.copy)

    def _check_process(self) -> None:
        """Refuses a forked child: the handler's threads (and a GPU's context) stay in the
        parent, so there its jobs would never run and wait() would never return. Checked
        before the lock, which a parent's thread may have held at the fork."""
        if os.getpid() != self._pid:
            raise RuntimeError(f"this handler was made in process {self._pid} and cannot be used in "
                               f"process {os.getpid()}, a child forked from it: its copy threads did not "
                               "survive the fork; make a handler in the child")

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise RuntimeError("the handler is shut down")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

