"""Where transfer jobs run: CUDA streams on a GPU, or host threads without one.

A lane runs its jobs in submission order; a job can also wait for jobs of other lanes.
Both kinds measure each job's time from its first to its last byte moved. Lanes copy
unchecked: the handler checks every job against its registry before submitting it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
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

    def submit(self, lane, copy, waits):
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


class HostLanes:
    """One worker thread per lane; a job is a callable that copies when called."""

    def __init__(self, lanes: list[str]):
        self._workers = {lane: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=lane)
                         for lane in lanes}

    def submit(self, lane, copy, waits):
        return self._workers[lane].submit(self._run, copy, list(waits))

    @staticmethod
    def _run(copy, waits):
        for other in waits:
            if other.exception() is not None:
                raise RuntimeError(f"depends on failed job: {other.exception()}")
        start = time.perf_counter()
        copy()
        return time.perf_counter() - start

    @staticmethod
    def submit_error(handle) -> str | None:
        del handle  # a host job fails only as it runs
        return None

    def done(self, handle) -> bool:
        return handle.done()

    def wait(self, handle) -> None:
        concurrent.futures.wait([handle])

    def finish(self, handle) -> tuple[float, str | None]:
        error = handle.exception()
        return (0.0, f"{type(error).__name__}: {error}") if error else (handle.result(), None)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=True)
