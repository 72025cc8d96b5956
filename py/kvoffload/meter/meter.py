"""What copies kept in flight cost a model running beside them: kvoffload's meter.

One continuous stream of compute steps (kvoffload.meter.compute_loop.ComputeLoop, a CUDA graph
a step) is cut into windows of ``steps`` counted steps each: idle, busy, idle, busy, ...
A busy window has one copy source (a ``Copies``) kept in flight from ``margin`` steps
before its first counted step until after its last; the idle windows on either side
of it are its reference. Each source is measured in ``rounds`` busy windows, the sources
interleaved, so that a slow drift of clocks falls on all of them alike.

Per busy window:
- ``step_slowdown``: its mean step over the mean of the idle windows just before and
  after, minus 1;
- ``idle_drift``: the idle window after over the one before, minus 1: the noise of that
  comparison. A result whose |drift| exceeds NOISE in any of its windows is ``noisy``
  and says nothing of a smaller slowdown.
The steps are enqueued ``AHEAD_SECONDS`` ahead of the GPU; the copies are fed from a
thread of their own. A step enqueued only after the GPU had finished the one before
(a source whose host work holds the GIL long) counts in ``dry_steps``: its time then
holds a wait for the host, not only the copies' cost.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Callable, Protocol

from ..util.arguments import require_int

# Steps enqueued ahead of the GPU. The driver's launch queue holds about 70 steps of one
# layer (190 ms on the H200); past it a launch blocks, and with it the copies' submission.
AHEAD_SECONDS = 0.12
STEPS = 100  # counted steps a window, at least
WINDOW_SECONDS = 1.2  # and at least this long
MARGIN_SECONDS = 0.15  # uncounted before each window: copies ramp up or drain
# Uncounted steps before the first window. From cold, the loop's step time settles over
# its first 4-6 s on the H200 (docs/measuring.md).
WARM_SECONDS = 8.0
ROUNDS = 2
NOISE = 0.003  # |idle drift| above this in a window marks the result noisy
# The calibrations' loop (kvoffload.meter.compute_loop): on the H200 the prefill loop ("model")
# runs at the power limit and its idle drift reaches the effects judged; decode does not.
CALIBRATION_WORKLOAD = "decode"
POLL_SECONDS = 1e-4


class Copies(Protocol):
    """A copy source kept in flight: ``top_up`` submits until its jobs in flight reach
    their depth (and collects finished ones) without blocking; ``drain`` waits for all
    and returns the bytes moved since the first top_up."""

    def top_up(self) -> None: ...

    def drain(self) -> int: ...


@dataclasses.dataclass
class Result:
    gb_per_s: float  # beside the loop, from the first submission to the last byte
    step_slowdown: float  # mean over its busy windows
    idle_drift: float  # the largest in magnitude over its windows, signed
    windows: list[dict]  # per busy window: step_slowdown, idle_drift, idle_step_seconds
    dry_steps: int
    idle_step_seconds: float  # mean of the idle windows around its busy ones

    @property
    def noisy(self) -> bool:
        """Some window's idle drift, or copies that did not cover it, leave its slowdown
        meaningless."""
        return abs(self.idle_drift) > NOISE or not all(w["covered"] for w in self.windows)

    def summary(self) -> str:
        noise = " NOISY" if self.noisy else ""
        dry = f", {self.dry_steps} dry steps" if self.dry_steps else ""
        return (f"{self.gb_per_s:6.1f} GB/s beside, step {self.step_slowdown:+.2%} "
                f"(idle drift {self.idle_drift:+.2%}{noise}{dry})")


def alone(copies: Copies, seconds: float = 1.5, warm_seconds: float = 0.3) -> float:
    """GB/s of the source kept in flight with nothing beside it (steady: after a warm-up)."""
    end = time.perf_counter() + warm_seconds
    while time.perf_counter() < end:
        copies.top_up()
        time.sleep(POLL_SECONDS)
    copies.drain()
    start = time.perf_counter()
    end = start + seconds
    while time.perf_counter() < end:
        copies.top_up()
        time.sleep(POLL_SECONDS)
    moved = copies.drain()
    return moved / (time.perf_counter() - start) / 1e9


class _Stream:
    """The loop's steps, enqueued AHEAD ahead of the GPU, with the GPU's progress polled."""

    def __init__(self, loop, total: int):
        torch = loop.torch
        self.loop, self.torch = loop, torch
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(total + 1)]
        self.enqueued = 0
        self.done = 0  # steps the GPU has finished, as last polled
        self.dry = set()

    def finished(self) -> int:
        """Steps the GPU has finished now, asked of the events (from any thread)."""
        done, enqueued = self.done, self.enqueued  # events up to `enqueued` are recorded
        while done < enqueued and self.events[done + 1].query():
            done += 1
        return done

    def poll(self) -> None:
        self.done = self.finished()

    def enqueue(self) -> None:
        """The next step, once the GPU is at most AHEAD behind."""
        i = self.enqueued
        if i and self.events[i].query():
            self.dry.add(i - 1)  # the GPU finished step i-1 before step i was enqueued
        with self.torch.cuda.device(self.loop.stream.device), self.torch.cuda.stream(self.loop.stream):
            if i == 0:
                self.events[0].record(self.loop.stream)
            self.loop.graph.replay()
            self.events[i + 1].record(self.loop.stream)
        self.enqueued += 1

    def step_seconds(self, first: int, end: int) -> float:
        """Mean seconds of steps [first, end)."""
        return self.events[first].elapsed_time(self.events[end]) / 1e3 / (end - first)


class _Feeder(threading.Thread):
    """Keeps one source's copies in flight, on a thread of its own as a server's offload
    worker would be, until ``finish``; then drains them. A source's host work then holds
    up the loop's enqueueing only as much as it holds the GIL."""

    def __init__(self, phase: int, copies: Copies, stream: _Stream):
        super().__init__(daemon=True)
        self.phase, self.copies, self.stream = phase, copies, stream
        self.finish = threading.Event()
        self.started_at, self.started = stream.finished(), time.perf_counter()  # step then running
        self.error = None

    def run(self) -> None:
        try:
            while not self.finish.is_set():
                self.copies.top_up()
                time.sleep(POLL_SECONDS)
            self.moved = self.copies.drain()
            self.seconds = time.perf_counter() - self.started
            self.drained_at = self.stream.finished() + 1  # past the step running at the end
        except BaseException as e:  # noqa: BLE001 - raised on the measuring thread
            self.error = e


def _window_steps(loop) -> int:
    return max(STEPS, math.ceil(WINDOW_SECONDS / loop.step_seconds))


def _warm_steps(loop) -> int:
    return math.ceil(WARM_SECONDS / loop.step_seconds)


def _ahead(loop) -> int:
    return max(4, min(40, math.ceil(AHEAD_SECONDS / loop.step_seconds)))


def measure(loop, sources: dict[str, Callable[[], Copies]], steps: int | None = None,
            rounds: int = ROUNDS, margin: int | None = None, warm: int | None = None) -> dict[str, Result]:
    """Each source (a function returning the Copies to keep in flight) in ``rounds`` busy
    windows beside ``loop``, between idle windows (see the module doc). steps, margin: per
    window; warm: steps run before the first window. Default: STEPS and WINDOW_SECONDS,
    MARGIN_SECONDS and WARM_SECONDS of the loop's steps."""
    steps = steps if steps is not None else _window_steps(loop)
    margin = margin if margin is not None else max(4, math.ceil(MARGIN_SECONDS / loop.step_seconds))
    warm = warm if warm is not None else _warm_steps(loop)
    for name, value, least in (("steps", steps, 1), ("rounds", rounds, 1), ("margin", margin, 2),
                               ("warm", warm, 0)):
        require_int(name, value, least)
    names = list(sources)
    # Phases in order: None is idle.
    phases: list[str | None] = [None]
    for _ in range(rounds):
        for name in names:
            phases += [name, None]
    span = margin + steps
    total = warm + len(phases) * span + margin
    stream = _Stream(loop, total)
    window_starts = [warm + p * span + margin for p in range(len(phases))]
    spans: dict[int, tuple[float, int, int, int]] = {}  # phase -> (seconds, bytes, drained at, started at)
    active: _Feeder | None = None

    def collect() -> None:
        nonlocal active
        active.join()
        feeder, active = active, None
        if feeder.error is not None:
            raise feeder.error
        spans[feeder.phase] = (feeder.seconds, feeder.moved, feeder.drained_at, feeder.started_at)

    def wait_and_feed(until_done: int) -> None:
        nonlocal active
        while True:
            stream.poll()
            if active is not None and active.phase not in spans:
                if stream.done >= window_starts[active.phase] + steps:  # the GPU finished the window
                    active.finish.set()
                if not active.is_alive():
                    collect()
            if active is None:
                p = (stream.done - warm) // span  # phase p: its margin, then its window; step `done` runs
                if 0 <= p < len(phases) and phases[p] is not None and p not in spans:
                    active = _Feeder(p, sources[phases[p]](), stream)
                    active.start()
            if stream.done >= until_done:
                return
            time.sleep(POLL_SECONDS)

    ahead = _ahead(loop)
    try:
        for i in range(total):
            wait_and_feed(i - ahead)
            stream.enqueue()
        wait_and_feed(total)
    finally:
        if active is not None:  # still draining at the end, or stopped by an error
            active.finish.set()
            collect()
        loop.torch.cuda.synchronize()

    means = [stream.step_seconds(s, s + steps) for s in window_starts]
    results: dict[str, list] = {name: [] for name in names}
    for p, name in enumerate(phases):
        if name is None:
            continue
        # A window whose copies never started (the one before drained through it) is
        # not covered.
        seconds, moved, drained_at, started_at = spans.get(p, (1.0, 0, total + 1, total))
        # The copies ran from before the window's first step until they drained, which
        # must come before the next idle window; and the idle window before this one was
        # idle: the copies of the busy window before it had drained by then.
        before_drained = p < 2 or spans.get(p - 2, (0, 0, total + 1, 0))[2] <= window_starts[p - 1]
        covered = started_at + 1 <= window_starts[p] and drained_at <= window_starts[p + 1] and before_drained
        before, after = means[p - 1], means[p + 1]
        dry = len(stream.dry & set(range(window_starts[p] - 1, window_starts[p] + steps)))
        results[name].append(dict(step_slowdown=means[p] / ((before + after) / 2) - 1,
                                  idle_drift=after / before - 1, gb_per_s=moved / seconds / 1e9,
                                  dry_steps=dry, covered=covered, idle_step_seconds=(before + after) / 2))
    return {name: Result(sum(w["gb_per_s"] for w in ws) / len(ws),
                         sum(w["step_slowdown"] for w in ws) / len(ws),
                         max((w["idle_drift"] for w in ws), key=abs), ws,
                         sum(w["dry_steps"] for w in ws),
                         sum(w["idle_step_seconds"] for w in ws) / len(ws))
            for name, ws in results.items()}


def clean_step_seconds(loop, steps: int | None = None, warm: int | None = None) -> float:
    """The loop's mean step over ``steps`` after ``warm``, run before any source is made in
    the process (defaults as measure's). A source that changes the whole device beyond its
    window (a persisting L2 set-aside) slows the idle windows too, so step_slowdown cannot
    see it; a Result's idle_step_seconds against this can."""
    steps = steps if steps is not None else _window_steps(loop)
    warm = warm if warm is not None else _warm_steps(loop)
    require_int("steps", steps, 1)
    require_int("warm", warm, 0)
    stream = _Stream(loop, warm + steps)
    ahead = _ahead(loop)
    for _ in range(warm + steps):
        while stream.enqueued - stream.done > ahead:
            time.sleep(POLL_SECONDS)
            stream.poll()
        stream.enqueue()
    loop.torch.cuda.synchronize()
    return stream.step_seconds(warm, warm + steps)

