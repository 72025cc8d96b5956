"""kvoffload.meter without a GPU: a simulated GPU runs the loop's steps in real time, each
step slower by SLOW while a source's copies are in flight. The meter must find that
slowdown for the slowing source and none for a harmless one, with every window covered
and no drift (the simulated clock has none)."""

import contextlib
import time

import pytest

from kvoffload.meter import meter

STEP = 0.004  # simulated seconds a step
SLOW = 0.10
COLD = 0.05


class FakeGPU:
    """Steps and events in order; a step starts when enqueued and the one before is done."""

    def __init__(self, cold_steps=0):
        self.pending, self.end, self.busy = [], 0.0, []  # busy: [start, end] of copies in flight
        self.cold_steps = cold_steps  # the first steps run COLD faster, as a cold GPU's do
        self.steps = 0

    def busy_at(self, t):
        return any(start <= t < end for start, end in self.busy)

    def advance(self, until):
        while self.pending:
            kind, item, enqueued = self.pending[0]
            start = max(self.end, enqueued)
            if start > until:
                return
            self.pending.pop(0)
            if kind == "event":
                item.ts = start
            else:
                cold = 1 - COLD if self.steps < self.cold_steps else 1
                self.end = start + STEP * cold * (1 + SLOW if item and self.busy_at(start) else 1)
                self.steps += 1


class FakeEvent:
    def __init__(self, gpu):
        self.gpu, self.ts = gpu, None

    def record(self, stream=None):
        self.gpu.pending.append(("event", self, time.perf_counter()))

    def query(self):
        self.gpu.advance(time.perf_counter())
        return self.ts is not None and self.ts <= time.perf_counter()

    def elapsed_time(self, other):
        return (other.ts - self.ts) * 1e3


class FakeLoop:
    def __init__(self, cold_steps=0):
        gpu = self.gpu = FakeGPU(cold_steps)
        cuda = type("cuda", (), dict(Event=lambda self, enable_timing=False: FakeEvent(gpu),
                                     device=lambda self, d: contextlib.nullcontext(),
                                     stream=lambda self, s: contextlib.nullcontext(),
                                     synchronize=lambda self: self._sync()))()
        cuda._sync = self.synchronize
        self.torch = type("torch", (), {"cuda": cuda})()
        self.stream = type("stream", (), {"device": None})()
        self.graph = type("graph", (), {"replay": lambda _: gpu.pending.append(("step", True, time.perf_counter()))})()
        self.step_seconds = STEP

    def synchronize(self):
        while self.gpu.pending:
            self.gpu.advance(time.perf_counter())
            time.sleep(STEP / 4)


class Source:
    """Copies whose time in flight slows the fake GPU (or not), and that record it."""

    def __init__(self, gpu, slows):
        self.gpu, self.slows, self.interval = gpu, slows, None

    def top_up(self):
        if self.interval is None:
            self.interval = [time.perf_counter(), float("inf")]
            if self.slows:
                self.gpu.busy.append(self.interval)

    def drain(self):
        time.sleep(STEP)  # the last copies finish
        self.interval[1] = time.perf_counter()
        return 1 << 30


def test_the_slowing_source_shows_its_slowdown_and_the_harmless_one_none():
    loop = FakeLoop()
    made = {"slow": [], "harmless": []}

    def source(name):
        def make():
            made[name].append(Source(loop.gpu, name == "slow"))
            return made[name][-1]
        return make

    got = meter.measure(loop, {name: source(name) for name in made}, steps=40, rounds=2, margin=8, warm=0)
    assert [len(made[n]) for n in made] == [2, 2]  # a fresh source per busy window
    for name, result in got.items():
        assert len(result.windows) == 2
        assert all(w["covered"] for w in result.windows), result.windows
        assert abs(result.idle_drift) < 1e-3  # a step slowed in an idle window shows here
        assert not result.noisy
        want = SLOW if name == "slow" else 0.0
        assert result.step_slowdown == pytest.approx(want, abs=5e-4), result.windows
        assert result.idle_step_seconds == pytest.approx(STEP, rel=2e-3)  # the idle windows', not the busy
        assert result.gb_per_s > 0


def test_a_source_that_raises_stops_the_measurement_with_its_error():
    loop = FakeLoop()

    class Broken(Source):
        def top_up(self):
            raise OSError("copies broke")

    with pytest.raises(OSError, match="copies broke"):
        meter.measure(loop, {"broken": lambda: Broken(loop.gpu, False)}, steps=10, rounds=1, margin=4, warm=0)


@pytest.mark.parametrize("bad, match", [(dict(steps=0), "steps: must be >= 1, got 0"),
                                        (dict(rounds=0), "rounds: must be >= 1, got 0"),
                                        (dict(margin=1), "margin: must be >= 2, got 1"),
                                        (dict(rounds=1.5), "rounds: expected an int, got float"),
                                        (dict(warm=-1), "warm: must be >= 0, got -1")])
def test_bad_arguments_are_named(bad, match):
    args = dict(steps=10, rounds=1, margin=4, warm=0) | bad
    with pytest.raises((ValueError, TypeError), match=match):
        meter.measure(FakeLoop(), {"a": lambda: None}, **args)


def test_a_source_that_drains_into_the_next_idle_window_leaves_the_next_busy_one_uncovered():
    # The late drain runs in the idle window that is the next source's baseline.
    loop = FakeLoop()

    class SlowDrain(Source):
        def drain(self):
            time.sleep(30 * STEP)  # past the margin, into the idle window after
            return super().drain()

    got = meter.measure(loop, {"late": lambda: SlowDrain(loop.gpu, True),
                               "next": lambda: Source(loop.gpu, False)}, steps=40, rounds=1, margin=8,
                        warm=0)
    assert not got["late"].windows[0]["covered"]
    assert not got["next"].windows[0]["covered"] and got["next"].noisy


@pytest.mark.parametrize("warm", [0, 60])
def test_the_warm_up_keeps_a_cold_start_out_of_the_first_window(warm):
    # The first 50 steps run fast: without a warm-up they are the first idle window,
    # and the first busy window's drift and slowdown show them.
    loop = FakeLoop(cold_steps=50)
    got = meter.measure(loop, {"harmless": lambda: Source(loop.gpu, False)}, steps=40, rounds=2,
                        margin=8, warm=warm)["harmless"]
    first = got.windows[0]
    if warm:
        assert abs(first["idle_drift"]) < 1e-3, got.windows
        # A step the host fed late (a loaded machine) slows the window whatever the
        # warm-up did: the meter counts it, and its slowdown says nothing.
        assert first["dry_steps"] or abs(first["step_slowdown"]) < 5e-4, got.windows
        assert not got.noisy
    else:
        assert first["idle_drift"] > meter.NOISE and got.noisy, got.windows


def test_a_source_that_slows_the_device_for_good_shows_against_the_clean_loop_not_in_its_slowdown():
    # Its copies leave the device slower after they drain, as a persisting L2 set-aside does:
    # its idle windows are slowed as much as its busy ones.
    loop = FakeLoop()

    class Lingering(Source):
        def drain(self):
            moved = super().drain()
            self.interval[1] = float("inf")
            return moved

    clean = meter.clean_step_seconds(loop, steps=40, warm=0)
    assert clean == pytest.approx(STEP, rel=2e-3)
    harmless = meter.measure(loop, {"harmless": lambda: Source(loop.gpu, False)}, steps=40, rounds=1, margin=8,
                             warm=0)["harmless"]
    assert harmless.idle_step_seconds / clean - 1 == pytest.approx(0.0, abs=2e-3)
    got = meter.measure(loop, {"lingering": lambda: Lingering(loop.gpu, True)}, steps=40, rounds=2, margin=8,
                        warm=0)["lingering"]
    assert abs(got.windows[1]["step_slowdown"]) < 2e-3, got.windows  # its idle windows slowed alike
    assert got.windows[1]["idle_step_seconds"] / clean - 1 == pytest.approx(SLOW, rel=0.05)


@pytest.mark.parametrize("bad, match", [(dict(steps=0), "steps: must be >= 1, got 0"),
                                        (dict(warm=-1), "warm: must be >= 0, got -1")])
def test_the_clean_steps_bad_arguments_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        meter.clean_step_seconds(FakeLoop(), **(dict(steps=10, warm=0) | bad))
