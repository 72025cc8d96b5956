"""Copy sources that kvoffload.meter keeps in flight: bulk copies (the reference), calls of
a raw-pointer copy method, and the jobs of an offloading worker (vLLM's verbs, kvoffload's
or vLLM's own, or an OffloadHandler's)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from ..util.arguments import require_int

DIRECTIONS = ("store", "load", "both")


def _directions(direction: str) -> tuple[str, ...]:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    return ("store", "load") if direction == "both" else (direction,)


class BulkCopies:
    """One plain copy of ``job_bytes`` a job between a pinned host buffer and device
    memory, ``depth`` jobs in flight per direction, each direction on its own stream:
    what the link moves with nothing but large DMA."""

    def __init__(self, torch, direction: str, job_bytes: int = 256 << 20, depth: int = 2, device="cuda"):
        directions = _directions(direction)
        require_int("job_bytes", job_bytes, 1)
        self.torch, self.depth = torch, require_int("depth", depth, 1)
        self.lanes = {}
        for d in directions:
            host = torch.empty(job_bytes, dtype=torch.uint8, pin_memory=True)
            gpu = torch.empty(job_bytes, dtype=torch.uint8, device=device)
            src, dst = (gpu, host) if d == "store" else (host, gpu)
            self.lanes[d] = (torch.cuda.Stream(device), src, dst, [])
        self.moved = 0

    def top_up(self) -> None:
        torch = self.torch
        for stream, src, dst, flying in self.lanes.values():
            while flying and flying[0].query():
                flying.pop(0)
                self.moved += src.numel()
            while len(flying) < self.depth:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                flying.append(event)

    def drain(self) -> int:
        for _, src, _, flying in self.lanes.values():
            for event in flying:
                event.synchronize()
                self.moved += src.numel()
            flying.clear()
        moved, self.moved = self.moved, 0
        return moved


# A call of a raw-pointer source lasts about this long alone: short against the meter's
# margin, so that its copies drain before the idle window after theirs.
CALL_SECONDS = 0.02


def in_calls(copy, src, dst, sizes, call_bytes: int) -> list[tuple]:
    """``copy(src, dst, sizes)`` as calls of about ``call_bytes`` each: (call, bytes) in
    order, every copy in one of them."""
    require_int("call_bytes", call_bytes, 1)
    ends = np.cumsum(sizes)
    cuts = np.searchsorted(ends, np.arange(call_bytes, ends[-1] if len(ends) else 0, call_bytes)) + 1
    bounds = np.unique(np.concatenate(([0], cuts, [len(sizes)]))).tolist()
    return [(functools.partial(copy, src[a:b], dst[a:b], sizes[a:b]), int(np.sum(sizes[a:b])))
            for a, b in zip(bounds, bounds[1:])]


class RawCopies:
    """Calls that each enqueue copies on ``stream``, ``calls`` as (call, bytes) taken in
    turn (in_calls), ``depth`` calls in flight: one raw-pointer method on one batch. A call
    given as (call, bytes, its stream) enqueues on that stream instead."""

    def __init__(self, torch, calls: list[tuple], stream, depth: int = 2):
        if not calls:
            raise ValueError("calls: expected (call, bytes) pairs, got none")
        self.torch, self.stream = torch, stream
        self.calls = itertools.cycle(list(calls))
        self.depth = require_int("depth", depth, 1)
        self.flying = []  # (event, bytes)
        self.moved = 0

    def top_up(self) -> None:
        while self.flying and self.flying[0][0].query():
            self.moved += self.flying.pop(0)[1]
        while len(self.flying) < self.depth:
            call, nbytes, *on = next(self.calls)
            call()
            event = self.torch.cuda.Event()
            event.record(on[0] if on else self.stream)
            self.flying.append((event, nbytes))

    def drain(self) -> int:
        for event, nbytes in self.flying:
            event.synchronize()
            self.moved += nbytes
        self.flying.clear()
        moved, self.moved = self.moved, 0
        return moved


class HandlerAsWorker:
    """An OffloadHandler behind vLLM's worker verbs, for WorkerCopies."""

    @dataclasses.dataclass
    class Result:
        job_id: int
        success: bool
        transfer_size: int

    def __init__(self, handler):
        self.handler = handler
        self.submit_store, self.submit_load, self.wait = handler.store, handler.load, handler.wait

    def get_finished(self) -> list[Result]:
        return [self.Result(r.job_id, r.success, r.bytes) for r in self.handler.get_finished()]


class WorkerCopies:
    """Jobs of a worker with vLLM's verbs (``submit_store``, ``submit_load``,
    ``get_finished``, ``wait``): ``jobs[direction]`` is a list of (GPU spec, CPU spec)
    taken in turn, ``depth`` jobs in flight per direction. For "both", give the two
    directions disjoint blocks and chunks."""

    _ids = itertools.count(1 << 40)  # job ids unique across sources in one process

    def __init__(self, worker, jobs: dict[str, list], direction: str, depth: int = 2):
        directions = _directions(direction)
        for d in directions:
            if not jobs.get(d):
                raise ValueError(f"jobs[{d!r}]: expected (GPU spec, CPU spec) pairs for a {direction!r} "
                                 f"source, got {jobs.get(d)!r}")
        self.worker, self.depth = worker, require_int("depth", depth, 1)
        self.specs = {d: itertools.cycle(list(jobs[d])) for d in directions}
        self.flying: dict[str, set] = {d: set() for d in self.specs}
        self.direction_of: dict[int, str] = {}
        self.moved = 0

    def _collect(self) -> None:
        for result in self.worker.get_finished():
            if not result.success:
                raise RuntimeError(f"job {result.job_id} failed")
            self.flying[self.direction_of.pop(result.job_id)].discard(result.job_id)
            self.moved += result.transfer_size

    def top_up(self) -> None:
        self._collect()
        for d, flying in self.flying.items():
            while len(flying) < self.depth:
                job_id = next(self._ids)
                gpu, cpu = next(self.specs[d])
                ok = (self.worker.submit_store(job_id, gpu, cpu) if d == "store"
                      else self.worker.submit_load(job_id, cpu, gpu))
                if not ok:
                    raise RuntimeError(f"job {job_id} was refused")
                flying.add(job_id)
                self.direction_of[job_id] = d

    def drain(self) -> int:
        while any(self.flying.values()):
            self.worker.wait(set().union(*self.flying.values()))
            self._collect()
        moved, self.moved = self.moved, 0
        return moved
