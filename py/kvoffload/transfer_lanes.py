"""Where transfer jobs run: CUDA streams on a GPU, or host threads without one.

A lane runs its jobs in submission order, so they finish in that order; a job can also
wait for jobs of other lanes, and fail when one of those it reads from failed
(``failing_with``). Both kinds measure each job's time from its first to its last byte
moved. Lanes copy unchecked: the handler checks every job against its registry before
submitting it. One thread submits at a time (the handler's lock); ``done`` and ``wait``
may be called from any thread, and a KeyboardInterrupt in ``wait`` leaves no lock held.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

from kvoffload.batch_copy import CudaError


@dataclasses.dataclass
class _CudaJob:
    start: object  # CUDA events around the job's copies
    end: object
    error: str | None  # set when submitting failed part way


class CudaLanes:
    """One CUDA stream per lane; a job starts after the compute stream's work so far.
    A job is a callable that enqueues its copies on the stream it is given."""

    def __init__(self, torch, device, lanes: list[str]):
        self._torch = torch
        self._device = device
        self._streams = {lane: torch.cuda.Stream(device, priority=-1 if lane == "expedited" else 0)
                         for lane in lanes}
        self._events = []  # (start, end) pairs to reuse

    def submit(self, lane, copy, waits, failing_with=()):
        del failing_with  # a failed CUDA job marks its chunks partial as it is submitted
        stream = self._streams[lane]
        stream.wait_stream(self._torch.cuda.current_stream(self._device))
        for other in waits:
            stream.wait_event(other.end)
        events = self._events.pop() if self._events else tuple(
            self._torch.cuda.Event(enable_timing=True) for _ in range(2))
        events[0].record(stream)
        error = None
        try:
            copy(stream=stream)
        except CudaError as e:
            # Copies enqueued before the failure still run: the job stays in flight
            # until they are done, so jobs that depend on it wait for them.
            error = f"CudaError: {e}"
        except Exception:
            self._events.append(events)
            raise
        events[1].record(stream)
        return _CudaJob(*events, error)

    @staticmethod
    def submit_error(handle) -> str | None:
        """Why submitting the job failed part way, or None."""
        return handle.error

    def done(self, handle) -> bool:
        return handle.end.query()

    def wait(self, handle) -> None:
        handle.end.synchronize()

    def finish(self, handle) -> tuple[float, str | None]:
        """(seconds, error) of a done job; its events may be reused afterwards."""
        seconds = handle.start.elapsed_time(handle.end) / 1e3
        self._events.append((handle.start, handle.end))
        return seconds, handle.error

    def fence(self, stream) -> None:
        """``stream`` waits for every job submitted so far."""
        for lane in self._streams.values():
            stream.wait_stream(lane)

    def close(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()


class _HostJob:
    def __init__(self, copy, waits, failing_with):
        self.copy = copy
        self.waits, self.failing_with = list(waits), list(failing_with)
        self.seconds, self.error = 0.0, None
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

    def submit(self, lane, copy, waits, failing_with=()):
        job = _HostJob(copy, waits, failing_with)
        self._queues[lane].put(job)
        return job

    @staticmethod
    def _work(jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
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
            except Exception as e:  # reported as the job's failure
                job.error = f"{type(e).__name__}: {e}"
            finally:
                job.running.release()

    @staticmethod
    def submit_error(handle) -> str | None:
        del handle  # a host job fails only as it runs
        return None

    @staticmethod
    def done(handle) -> bool:
        return not handle.running.locked()

    @staticmethod
    def wait(handle) -> str | None:
        with handle.running:  # a C lock: an interrupt cannot leave it held
            return handle.error  # a statement: an exception raised at a bare `pass` skips the release

    @staticmethod
    def finish(handle) -> tuple[float, str | None]:
        return handle.seconds, handle.error

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
