"""Asynchronous KV-cache transfer jobs: store (GPU -> CPU) and load (CPU -> GPU).

The handler owns the GPU tensors of every KV-cache group and a CPU pool beside them
(see kvoffload.host_pool for its layouts), one lane per direction and, optionally, an
expedited lane for urgent loads. Its API is vLLM's offload worker's:
``transfer_async``, ``get_finished``, ``wait``, ``shutdown``.

Safety by construction:
- every job starts after the work queued so far on the compute stream (the current
  stream at submission): a store reads finished blocks, a load overwrites idle ones;
- a job waits for every job in flight on another lane that touches the same GPU blocks
  or CPU chunks, where either writes them;
- a load reads its chunks with ANY only when no store in flight writes any of them;
  otherwise it waits for that store and reads in stream order (kvoffload.ordering);
- jobs of one lane run in submission order;
- every copy of every job lies inside the GPU tensors or the pool (``registry``),
  checked before the job is submitted.

Failures: a job whose copying fails (a CUDA error part way) is reported failed once the
copies it enqueued are done; other jobs and the handler go on. The CPU chunks a failed
store wrote are marked partial: a load of them fails, without copying, until a store
rewrites them. The GPU blocks of a failed load are the caller's to recompute.
Without a GPU (CPU tensors) the same jobs run on host threads with the host copy path.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Hashable, Iterable, Sequence

import numpy as np

from kvoffload import auto
from kvoffload.descriptor_pool import DescriptorPool
from kvoffload.host_pool import HostPool, kv_layout, pool_bytes, tensor_owners
from kvoffload.ordering import MemoryKind, PendingWrites, safe_order
from kvoffload.planner import CPUSpec, GPUSpec, block_bytes, chunks_used, plan_transfer
from kvoffload.registry import MemoryRegistry
from kvoffload.transfer_lanes import CudaLanes, HostLanes


class Direction(str, enum.Enum):
    STORE = "store"  # GPU -> CPU
    LOAD = "load"  # CPU -> GPU


@dataclasses.dataclass(frozen=True)
class TransferResult:
    job_id: Hashable
    success: bool
    direction: Direction
    bytes: int
    seconds: float  # first to last byte moved, from CUDA events (host timer without a GPU)
    error: str | None = None


@dataclasses.dataclass
class _Job:
    direction: Direction
    lane: str
    bytes: int
    gpu_keys: np.ndarray  # (group << 40) | block id
    cpu_keys: np.ndarray  # (group << 40) | chunk id
    descriptors: np.ndarray
    handle: object
    seq: int = 0  # submission number

    @property
    def writes_cpu(self) -> bool:
        return self.direction is Direction.STORE

    def conflicts_with(self, other: "_Job") -> bool:
        """Whether the two jobs touch the same bytes and one of them writes them."""
        shared_gpu = np.isin(self.gpu_keys, other.gpu_keys).any()
        shared_cpu = np.isin(self.cpu_keys, other.cpu_keys).any()
        if self.direction is not other.direction:
            return bool(shared_gpu or shared_cpu)
        return bool(shared_cpu if self.direction is Direction.STORE else shared_gpu)


def _keys(ids: np.ndarray, counts: Sequence[int], alias: Sequence[int]) -> np.ndarray:
    """(group << 40) | id, where groups that share tensors count as one group."""
    groups = np.repeat(np.asarray(alias, dtype=np.int64), counts)
    return (groups << 40) | ids


class OffloadHandler:
    """Runs store and load jobs between GPU KV-cache tensors and a CPU pool.

    gpu_tensors[g][t]: tensor t of group g, blocks along dim 0, each block contiguous;
    a group's tensors share the block count; one tensor may appear in several groups
    (hybrid models), which then share its blocks and its CPU region. num_cpu_chunks:
    chunks per group (an int for all groups). page_bytes[g]: bytes moved per block of
    group g's tensors, an int or one per tensor (default: the whole block). host_buffer: a CPU tensor to use (and page-lock) as the pool
    instead of allocating one; ``pool_bytes`` says how large it must be. method: how
    jobs copy on a GPU ("auto", "batch", "per_copy", "kernel", "staged"; see
    kvoffload.auto), using at most ``sm_budget`` CTAs (None: no limit). With "auto", a
    machine without a cached calibration is measured here, taking some seconds and
    1 GiB each of pinned and device memory for the while.
    """

    def __init__(self, gpu_tensors: Sequence[Sequence], num_cpu_chunks: int | Sequence[int],
                 blocks_per_chunk: int, *, page_bytes: Sequence[int] | None = None,
                 cpu_layout: str = "chunk_major", host_buffer=None, expedited_loads: bool = False,
                 method: str = "auto", sm_budget: int | None = None):
        import torch

        gpu_tensors = [list(group) for group in gpu_tensors]
        devices = {t.device for group in gpu_tensors for t in group}
        if len(devices) != 1:
            raise ValueError(f"gpu_tensors: expected one device, got {sorted(map(str, devices))}")
        device = devices.pop()
        if isinstance(num_cpu_chunks, int):
            num_cpu_chunks = [num_cpu_chunks] * len(gpu_tensors)
        if len(num_cpu_chunks) != len(gpu_tensors):
            raise ValueError(f"num_cpu_chunks: has {len(num_cpu_chunks)} entries for "
                             f"{len(gpu_tensors)} groups")
        pages = [[block_bytes(t, f"gpu_tensors[{g}][{i}]") if page_bytes is None
                  else page_bytes[g] if isinstance(page_bytes[g], int) else page_bytes[g][i]
                  for i, t in enumerate(group)] for g, group in enumerate(gpu_tensors)]

        on_gpu = device.type == "cuda"
        self.pool = HostPool(torch, pool_bytes(pages, num_cpu_chunks, blocks_per_chunk,
                                               tensor_owners(gpu_tensors)),
                             host_buffer, pinned=on_gpu)
        self.layout = kv_layout(gpu_tensors, pages, num_cpu_chunks, blocks_per_chunk,
                                self.pool.base, cpu_layout)
        self.gpu_tensors = gpu_tensors
        self.registry = MemoryRegistry()
        registered = set()
        for g, group in enumerate(gpu_tensors):
            for i, t in enumerate(group):
                if t.numel() and t.data_ptr() not in registered:
                    registered.add(t.data_ptr())
                    self.registry.register_tensor(f"gpu_tensors[{g}][{i}]", t)
        if self.pool.nbytes:
            self.registry.register("host pool", self.pool.base, self.pool.nbytes, "host")
        self._gpu_kind = "device" if on_gpu else "host"
        lanes = ["store", "load"] + (["expedited"] if expedited_loads else [])
        if method != "auto" and method not in auto.METHODS:
            raise ValueError(f"method: expected 'auto' or one of {auto.METHODS}, got {method!r}")
        if on_gpu and method == "auto":
            auto.calibration()  # loaded, or measured now (seconds) rather than in the first job
        self._lanes = (CudaLanes(torch, device, lanes, method, sm_budget) if on_gpu
                       else HostLanes(lanes))
        self._load_source = MemoryKind.PINNED_HOST if on_gpu else MemoryKind.PAGEABLE_HOST
        self._expedited = expedited_loads
        self._descriptors = DescriptorPool()
        self._in_flight: dict[Hashable, _Job] = {}
        self._chunk_writer: dict[int, int] = {}  # cpu key -> sequence number of its last store
        self._failed_stores: dict[int, Hashable] = {}  # sequence number -> job id
        self._submitted = 0
        self._finished: list[TransferResult] = []
        self._closed = False

    def transfer_async(self, job_id: Hashable, src_spec: GPUSpec | CPUSpec,
                       dst_spec: GPUSpec | CPUSpec, expedite: bool = False) -> bool:
        """Plans and submits a job and returns at once: True if submitted, False if it
        failed at once (a load of partial chunks; get_finished() reports it). Raises
        before submitting anything on a reused job id, specs that do not fit the layout
        or copies outside the registered memory, or after shutdown."""
        self._check_open()
        if job_id in self._in_flight or any(r.job_id == job_id for r in self._finished):
            raise ValueError(f"job_id: {job_id!r} is already in use")
        if isinstance(src_spec, GPUSpec) and isinstance(dst_spec, CPUSpec):
            direction, gpu, cpu = Direction.STORE, src_spec, dst_spec
        elif isinstance(src_spec, CPUSpec) and isinstance(dst_spec, GPUSpec):
            direction, gpu, cpu = Direction.LOAD, dst_spec, src_spec
        else:
            raise TypeError("src_spec, dst_spec: expected (GPUSpec, CPUSpec) for a store or "
                            "(CPUSpec, GPUSpec) for a load")
        if expedite and (direction is Direction.STORE or not self._expedited):
            raise ValueError("expedite: only for loads, on a handler made with expedited_loads=True")
        plan = plan_transfer(self.layout, gpu, cpu)

        bpc = self.layout.blocks_per_chunk
        used = [chunks_used(n, b, bpc) for n, b in zip(gpu.group_sizes, gpu.block_indices)]
        job = _Job(direction, "expedited" if expedite else direction.value, plan.total_bytes,
                   _keys(gpu.block_ids, gpu.group_sizes, self.layout.gpu_alias),
                   _keys(cpu.chunk_ids, used, self.layout.cpu_alias), None, None)
        self._collect()
        waits = [other for other in self._in_flight.values()
                 if other.lane != job.lane and job.conflicts_with(other)]
        if direction is Direction.STORE:
            src, dst, sizes = plan.store()
            order = safe_order(MemoryKind.DEVICE, MemoryKind.PINNED_HOST, PendingWrites.UNKNOWN)
        else:
            src, dst, sizes = plan.load()
            pending = any(other.direction is Direction.STORE for other in waits)
            order = safe_order(self._load_source, MemoryKind.DEVICE,
                               PendingWrites.YES if pending else PendingWrites.NO)

        if direction is Direction.STORE:
            self.registry.check_copies(src, dst, sizes, self._gpu_kind, "host")
        else:
            self.registry.check_copies(src, dst, sizes, "host", self._gpu_kind)
            partial = [self._failed_stores[w] for w in map(self._chunk_writer.get, job.cpu_keys.tolist())
                       if w in self._failed_stores]
            if partial:
                self._finished.append(TransferResult(
                    job_id, False, direction, job.bytes, 0.0,
                    f"reads CPU chunks left partial by failed store {partial[0]!r}; nothing copied"))
                return False

        job.descriptors = self._descriptors.acquire(src, dst, sizes)
        n = len(sizes)
        job.handle = self._lanes.submit(
            job.lane, "d2h" if direction is Direction.STORE else "h2d", job.descriptors[0, :n],
            job.descriptors[1, :n], job.descriptors[2, :n], order, [w.handle for w in waits])
        self._submitted += 1
        job.seq = self._submitted
        self._in_flight[job_id] = job
        if job.writes_cpu:
            self._chunk_writer.update(dict.fromkeys(job.cpu_keys.tolist(), job.seq))
        if self._lanes.submit_error(job.handle) is not None:
            self._note_failure(job_id, job)
        return True

    def get_finished(self) -> list[TransferResult]:
        """The jobs that completed since the last call, without blocking."""
        self._collect()
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Iterable[Hashable]) -> None:
        """Blocks until these jobs are done; ids of jobs already done are ignored."""
        self._check_open()
        for job_id in job_ids:
            job = self._in_flight.get(job_id)
            if job is not None:
                self._lanes.wait(job.handle)

    def shutdown(self) -> None:
        """Waits for every job, then releases the lanes and the pool."""
        if self._closed:
            return
        self.wait(list(self._in_flight))
        self._collect()
        self._lanes.close()
        self.pool.release()
        self._closed = True

    @property
    def descriptor_arrays_allocated(self) -> int:
        return self._descriptors.allocated

    def _collect(self) -> None:
        for job_id, job in list(self._in_flight.items()):
            if self._lanes.done(job.handle):
                seconds, error = self._lanes.finish(job.handle)
                self._descriptors.release(job.descriptors)
                del self._in_flight[job_id]
                if error is not None:
                    self._note_failure(job_id, job)
                self._finished.append(
                    TransferResult(job_id, error is None, job.direction, job.bytes, seconds, error))

    def _note_failure(self, job_id: Hashable, job: _Job) -> None:
        if job.writes_cpu:
            self._failed_stores[job.seq] = job_id

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the handler is shut down")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
