"""Where transfer jobs run: CUDA streams on a GPU, or host threads without one.

A lane runs its jobs in submission order, so they finish in that order; a job can also
wait for jobs of other lanes, and fail when one of those it reads from failed
(``failing_with``). Both kinds measure each job's time from its start to its last byte
moved; a pipelined job, which may start while the one before it still copies, from the
end of that one if later. Lanes copy
unchecked: the handler checks every job against its registry before submitting it. One
thread submits at a time (the handler's lock); ``done`` and ``wait`` may be called from
any thread, and a KeyboardInterrupt in ``wait`` leaves no lock held. A job that fails
as it is enqueued or run is reported by ``finish``, never raised.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
import weakref
from typing import Callable, Protocol, Sequence

from .. import _C


class Lanes(Protocol):
    """What CudaLanes and HostLanes both do; the handler holds one of them and calls
    nothing else. ``make`` builds a job that runs ``copy`` once its ``waits`` (handles of
    other lanes' jobs) are done; ``start`` queues it; ``wait``, ``result`` and ``recycle``
    retire it. ``resolve`` (CUDA lanes only) finds the waits on the lane's enqueue thread
    instead."""

    def make(self, lane: str, copy: Callable, waits: Sequence, failing_with: Sequence = (),
             pipelined: bool = False, resolve: Callable | None = None): ...

    def start(self, handle) -> None: ...

    def done(self, handle) -> bool: ...

    def wait(self, handle): ...

    def result(self, handle) -> tuple[float, str | None]: ...

    def recycle(self, handle) -> None: ...

    def fence(self, stream) -> None: ...

    def require_not_capturing(self) -> None: ...

    def close(self) -> None: ...


class _CudaJob:
    def __init__(self, ready, start, end, failing_with):
        self.ready, self.start, self.end = ready, start, end  # CUDA events
        self.failing_with = failing_with
        self.error: str | None = None  # set when enqueueing failed or was skipped
        self.recorded = False  # end was recorded: the job's copies are on its stream
        self.recycled = False  # its events went back to the lane set: done, whatever they say now
        # A pipelined job's time starts no earlier than the end of the job before it
        # (timed_from), whose events stay out of the pool (held_by) until this job's go.
        self.timed_from = self.held_by = None
        self.held_events = []  # events of jobs before it, returned with its own
        self.queued = threading.Lock()  # held until the job is enqueued or has failed
        self.queued.acquire()
        self.turn_over = False  # it found its conflicts (_Turns)


def _require_not_capturing(stream, name: str) -> None:
    _C.require_not_capturing(stream, name)


def _relaxed(fn):
    """fn() with this thread's CUDA calls (event queries, waits) allowed while another
    thread captures a graph in global mode (torch.cuda.graph's default), which would
    otherwise refuse them and invalidate that capture."""
    return _C.in_relaxed_capture_mode(fn)


class CudaLanes:
    """Two CUDA streams per lane; a job starts after the compute stream's work so far.
    A job is a callable that enqueues its copies on the stream it is given.

    A job runs on the stream of the lane's job before it, and so after it; but two
    pipelined jobs in a row (whose copies keep their own order, as the staging ring's
    in-order streams do) go on the lane's two streams: the second one's waits are then
    met while the first still copies, and its copies follow the first's with no drain.

    submit() only records where the compute stream stands and queues the job; one
    thread per lane enqueues its jobs, so the caller's thread never pays for enqueueing
    (a driver call per page for DMA), and one lane's enqueueing never holds up
    another's. Jobs resolve (``resolve``) one at a time in submission order, whichever
    lane's thread runs them; a job that waits for another lane's job waits on the host
    until that one is enqueued, then on its stream for its end."""

    def __init__(self, torch, device, lanes: list[str]):
        self._torch = torch
        self._device = device
        self._streams = {lane: tuple(torch.cuda.Stream(device, priority=-1 if lane == "expedited" else 0)
                                     for _ in range(2)) for lane in lanes}
        self._events = []  # (ready, start, end) to reuse
        self._last = {}  # per lane, the job started last
        self._turns = _Turns()
        self._queues = {lane: queue.SimpleQueue() for lane in lanes}
        self._threads = [threading.Thread(target=self._lane_thread, args=(q, self._turns),
                                          name=f"kvoffload enqueue {lane}", daemon=True)
                         for lane, q in self._queues.items()]
        for thread in self._threads:
            thread.start()
        for q in self._queues.values():  # a lane set never closed ends its threads
            weakref.finalize(self, q.put, None)

    def make(self, lane, copy, waits, failing_with=(), pipelined=False, resolve=None):
        """A job that starts after the compute stream's work so far, once start()ed.
        resolve: called with the job on the enqueue thread just before it is enqueued,
        after every job started before it; returns more (waits, failing_with)."""
        torch = self._torch
        events = self._events.pop() if self._events else (
            torch.cuda.Event(), torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record(torch.cuda.current_stream(self._device))
        job = _CudaJob(*events, list(failing_with))
        job.lane = lane
        job.item = (job, lane, self._streams[lane], copy, list(waits), pipelined, resolve)
        return job

    def start(self, handle) -> None:
        """Queues the job; starting it again is harmless (it runs once)."""
        self._last[handle.lane] = handle
        item = handle.item  # None once the enqueue thread took it: never queue the stop signal
        if item is None:
            return
        # Started again after an interrupt, the job is queued twice at most, and its
        # thread takes it once (see _enqueue_jobs); its turn is added once.
        self._turns.add(handle)
        self._queues[handle.lane].put(item)

    @staticmethod
    def _lane_thread(jobs: queue.SimpleQueue, turns: "_Turns") -> None:
        """The lane's jobs, enqueued in relaxed capture mode (the queries and waits of
        resolving them too); in the thread's own mode only where CUDA would not relax it,
        and then a capture elsewhere may fail some of them, by name."""
        started = []
        try:
            _relaxed(lambda: started.append(True) or CudaLanes._enqueue_jobs(jobs, turns))
        except BaseException:
            if started:
                raise
            CudaLanes._enqueue_jobs(jobs, turns)

    @staticmethod
    def _enqueue_jobs(jobs: queue.SimpleQueue, turns: "_Turns") -> None:
        index, tail_pipelined, before = 0, False, None  # the lane's job enqueued last
        while (item := jobs.get()) is not None:
            job, lane, streams, copy, waits, pipelined, resolve = item
            if job.item is None:
                continue  # started twice
            job.item = None
            after = None  # a job on the other stream still ends after the one before it
            if pipelined and tail_pipelined:
                index, after = 1 - index, before
                # Marked first, read second (recycle() does the opposite): of a race,
                # at least one side sees the other, and no event is reused while timed.
                before.held_by = job
                if not before.recycled:
                    job.timed_from = before
                else:  # done and collected: its events may be another job's by now
                    before.held_by = after = None
            tail_pipelined, before = pipelined, job
            stream = streams[index]
            try:
                with turns.of(job):
                    if resolve is not None:
                        try:
                            more_waits, more_failing = resolve(job)
                            waits, job.failing_with = waits + more_waits, job.failing_with + more_failing
                        except Exception as e:  # noqa: BLE001 - reported as the job's failure
                            job.error = f"{type(e).__name__}: {e}"
                stream.wait_event(job.ready)
                for other in waits:  # started before this one, on any lane's thread
                    with other.queued:
                        recorded = other.recorded
                    # A recycled job is done, and its events may be a later job's by now.
                    if recorded and not other.recycled:
                        stream.wait_event(other.end)
                for other in job.failing_with:  # an error is known once the job is enqueued
                    with other.queued:
                        pass
                failed = [other.error for other in job.failing_with if other.error is not None]
                job.start.record(stream)
                try:
                    if failed and job.error is None:
                        job.error = f"reads bytes a failed job left partial ({failed[0]}); nothing copied"
                    if job.error is None:
                        copy(stream=stream)
                except BaseException as e:
                    # Copies enqueued before the failure still run: the job stays in
                    # flight until they are done, so jobs that depend on it wait.
                    job.error = f"{type(e).__name__}: {e}"
                finally:
                    # Even when it copied nothing through the ring (it failed, or read
                    # partial bytes): other lanes wait only for a lane's latest job.
                    if after is not None and after.recorded:
                        stream.wait_event(after.end)
                    job.end.record(stream)
                    job.recorded = True
            except BaseException as e:  # a stream or event call failed
                job.error = job.error or f"{type(e).__name__}: {e}"
            finally:
                job.queued.release()

    @staticmethod
    def done(handle) -> bool:
        if handle.recycled or handle.queued.locked():
            return handle.recycled
        if not handle.recorded:
            return True
        return _relaxed(handle.end.query)

    @staticmethod
    def wait(handle) -> None:
        with handle.queued:  # a C lock: an interrupt cannot leave it held
            recorded = handle.recorded
        if recorded:
            _relaxed(handle.end.synchronize)

    @staticmethod
    def result(handle) -> tuple[float, str | None]:
        """(seconds, error) of a done job."""
        if not handle.recorded:
            return 0.0, handle.error
        return _relaxed(lambda: CudaLanes._timed(handle))

    @staticmethod
    def _timed(handle) -> tuple[float, str | None]:
        milliseconds = handle.start.elapsed_time(handle.end)
        before = handle.timed_from
        if before is not None and before.recorded:  # not the time it queued behind that job
            milliseconds = min(milliseconds, before.end.elapsed_time(handle.end))
        return milliseconds / 1e3, handle.error

    def recycle(self, handle) -> None:
        """A done job's events may be reused; again for the same job, a no-op."""
        if handle.recycled:
            return
        handle.recycled = True
        handle.timed_from = None  # else every job would keep all those before it
        held, handle.held_events = handle.held_events, []
        self._events += held
        events = (handle.ready, handle.start, handle.end)
        follower, handle.held_by = handle.held_by, None  # a kept handle keeps no later job
        if follower is not None and not follower.recycled:
            follower.held_events.append(events)
        else:
            self._events.append(events)

    def fence(self, stream) -> None:
        """``stream`` (None: the current stream) waits for every job submitted so far (the
        host waits until they are enqueued)."""
        if stream is None:
            stream = self._torch.cuda.current_stream(self._device)
        _require_not_capturing(stream, "stream")
        for last in list(self._last.values()):
            with last.queued:
                pass
        for streams in self._streams.values():
            for lane in streams:
                stream.wait_stream(lane)

    def require_not_capturing(self) -> None:
        """Raises ValueError where the current stream is capturing a CUDA graph: the job's
        first event, recorded there, would take the lane's stream into the graph, and its
        copies with it (recorded, never run)."""
        _require_not_capturing(self._torch.cuda.current_stream(self._device), "current stream")

    def close(self) -> None:
        """Enqueues what was started, ends the threads and waits for the streams. Idempotent.
        From a lane's own thread (a finalizer run there), only asks the threads to end:
        joining another lane's thread could wait on a job this thread is enqueueing."""
        for q in self._queues.values():
            q.put(None)
        if threading.current_thread() in self._threads:
            return
        for thread in self._threads:
            thread.join()
        for streams in self._streams.values():
            for stream in streams:
                _relaxed(stream.synchronize)


class _Turns:
    """Jobs take turns in the order they were started (``add``): ``of(job)`` waits until
    every job started before it has had its turn, and ends the job's turn when left."""

    def __init__(self):
        self._order = collections.deque()
        self._changed = threading.Condition()

    def add(self, job) -> None:
        """Once per job: again (a start after an interrupt) is a no-op, also after its
        turn is over."""
        with self._changed:
            if not job.turn_over and not (self._order and self._order[-1] is job):
                self._order.append(job)

    @contextlib.contextmanager
    def of(self, job):
        with self._changed:
            self._changed.wait_for(lambda: self._order and self._order[0] is job)
        try:
            yield
        finally:
            with self._changed:
                self._order.popleft()
                job.turn_over = True
                self._changed.notify_all()


class _HostJob:
    def __init__(self, copy, waits, failing_with):
        self.copy = copy
        self.waits, self.failing_with = list(waits), list(failing_with)
        self.seconds, self.error = 0.0, None
        self.taken = False  # a lane thread took it (a job started twice runs once)
        self.running = threading.Lock()  # held until the job is done
        self.running.acquire()


class HostLanes:
    """One worker thread per lane; a job is a callable that copies when called."""

    def __init__(self, lanes: list[str]):
        self._queues = {lane: queue.SimpleQueue() for lane in lanes}
        self._threads = [threading.Thread(target=self._work, args=(q,), name=f"kvoffload {lane}",
                                          daemon=True) for lane, q in self._queues.items()]
        for thread in self._threads:
            thread.start()

    def fence(self, stream) -> None:
        del stream
        raise RuntimeError("fence: only for a handler of GPU tensors")

    def require_not_capturing(self) -> None:
        pass  # no CUDA stream

    def make(self, lane, copy, waits, failing_with=(), pipelined=False, resolve=None):
        del pipelined  # a lane's thread runs one job at a time
        if resolve is not None:  # lanes run on threads of their own: no one order to resolve in
            raise ValueError("resolve: only CUDA lanes take it")
        job = _HostJob(copy, waits, failing_with)
        job.lane = lane
        return job

    def start(self, handle) -> None:
        """Queues the job; starting it again is harmless (it runs once)."""
        self._queues[handle.lane].put(handle)

    @staticmethod
    def _work(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            if job.taken:
                continue
            job.taken = True
            try:
                for other in job.waits:
                    HostLanes.wait(other)
                failed = [other.error for other in job.failing_with if other.error is not None]
                if failed:
                    job.error = f"reads bytes a failed job left partial ({failed[0]}); nothing copied"
                else:
                    start = time.perf_counter()
                    job.copy()
                    job.seconds = time.perf_counter() - start
            except BaseException as e:  # reported as the job's failure; the lane goes on
                job.error = f"{type(e).__name__}: {e}"
            finally:
                job.running.release()

    @staticmethod
    def done(handle) -> bool:
        return not handle.running.locked()

    @staticmethod
    def wait(handle) -> str | None:
        with handle.running:  # a C lock: an interrupt cannot leave it held
            return handle.error  # a statement: an exception raised at a bare `pass` skips the release

    @staticmethod
    def result(handle) -> tuple[float, str | None]:
        return handle.seconds, handle.error

    @staticmethod
    def recycle(handle) -> None:
        del handle

    def close(self) -> None:
        """Runs what was started, then ends the threads. Idempotent."""
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
