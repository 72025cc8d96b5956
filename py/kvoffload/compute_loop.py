"""What a copy costs a model running beside it, measured soundly.

Two compute loops, each step captured once as a CUDA graph so that the host enqueues
a whole loop in microseconds:
- ``model``: MODEL_LAYERS Llama-3.1-8B-shaped prefill layers (4096 tokens, 32 query / 8
  KV heads of 128, MLP 14336, RMSNorm, causal SDPA, bf16, random weights);
- ``gemm``: bf16 8192^3 matrix products, four per step.

The loop covers the whole copy window; the copies start after some warm-up steps (clocks
have fallen by then) and go back to back with no host sync. The driver's launch queue
holds about 70 of the model's steps (190 ms on the H200): a longer loop enqueued whole
before the copies blocked the host until its last steps, so copies of more than that
found no loop left to run beside. So the loop is enqueued AHEAD steps ahead of the GPU,
polling the step AHEAD back rather than blocking in the launch queue: the warm-up and
AHEAD steps more, then the copies (between pieces of them, as many steps as need no
wait), then the rest. Each step is timed from its start to the next one's, so that a
wait between steps counts against the step before it. A step in the copy window whose
successor was enqueued only after the GPU had finished it (the copies' host enqueueing
outlasted the steps ahead) is counted in ``dry_steps``: its time holds a wait for this
loop's host thread, which a model fed from its own thread would not see, and the
slowdown then says nothing. (An idle gap between steps is no such sign by itself: the
GPU can hold the next step back behind copies.)
GB/s is taken over the copies' own window, from events on their stream. Step time is
the mean of the steps whose events lie inside that window, against the same steps of the
same sustained loop run beside an idle stream in this process, just before and just
after (their mean; their difference is reported as the measurement's drift).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np

WORKLOADS = ("model", "gemm")
MODEL_LAYERS = 4  # a model step: enough layers that a step's launch is a small part of it
WARM_STEPS = {"model": 20, "gemm": 60}
AHEAD = 40  # steps enqueued ahead of the GPU, inside the launch queue
POLL_SECONDS = 2e-4
PIECE_BYTES = 32 << 20  # in_pieces: at 4 KiB a driver call per copy enqueues this in ~20 ms


def _model_step(torch, device):
    tokens, hidden, heads, kv_heads, head_dim, mlp = 4096, 4096, 32, 8, 128, 14336
    bf16 = dict(dtype=torch.bfloat16, device=device)
    scale = hidden ** -0.5
    w = {name: torch.randn(shape, **bf16) * scale for name, shape in {
        "q": (hidden, heads * head_dim), "k": (hidden, kv_heads * head_dim),
        "v": (hidden, kv_heads * head_dim), "o": (heads * head_dim, hidden),
        "gate": (hidden, mlp), "up": (hidden, mlp), "down": (mlp, hidden)}.items()}
    norm = torch.ones(hidden, **bf16)
    x = torch.randn(tokens, hidden, **bf16)
    F = torch.nn.functional

    def layer():
        h = F.rms_norm(x, (hidden,), norm)
        q = (h @ w["q"]).view(1, tokens, heads, head_dim).transpose(1, 2)
        k = (h @ w["k"]).view(1, tokens, kv_heads, head_dim).transpose(1, 2)
        v = (h @ w["v"]).view(1, tokens, kv_heads, head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + a.transpose(1, 2).reshape(tokens, heads * head_dim) @ w["o"]
        m = F.rms_norm(h, (hidden,), norm)
        return h + (F.silu(m @ w["gate"]) * (m @ w["up"])) @ w["down"]

    return lambda: [layer() for _ in range(MODEL_LAYERS)]


def _gemm_step(torch, device):
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    return lambda: [torch.mm(a, b) for _ in range(4)]


@dataclasses.dataclass
class Beside:
    gb_per_s: float  # the copies' rate over their window, beside the loop
    step_slowdown: float  # mean step inside the window over the same steps beside an idle stream
    steps_in_window: int
    step_seconds: float
    idle_step_seconds: float
    idle_drift: float  # the idle loop after over before, minus 1: this measurement's noise
    dry_steps: int  # steps in the window whose successor was enqueued only after they ended

    def summary(self) -> str:
        dry = f", the loop ran dry {self.dry_steps} times" if self.dry_steps else ""
        return (f"{self.gb_per_s:6.1f} GB/s, step slowdown {self.step_slowdown:+.1%} over "
                f"{self.steps_in_window} steps{dry}")


def _wait(event) -> None:
    """Polls the event, sleeping between polls, rather than waiting inside the driver."""
    while not event.query():
        time.sleep(POLL_SECONDS)


def _periods(events) -> list[float]:
    """Each step's seconds from its start to the next step's: a wait between steps counts
    against the step before it, as it would against a model."""
    starts = [before for before, _ in events[1:]] + [events[-1][1]]
    return [before.elapsed_time(end) / 1e3 for (before, _), end in zip(events, starts)]


def in_pieces(copy, src, dst, sizes, piece_bytes: int = PIECE_BYTES) -> list:
    """``copy(src, dst, sizes)`` as calls of about ``piece_bytes`` each, for beside()."""
    ends = np.cumsum(sizes)
    cuts = np.searchsorted(ends, np.arange(piece_bytes, ends[-1] if len(ends) else 0, piece_bytes)) + 1
    bounds = np.unique(np.concatenate(([0], cuts, [len(sizes)])))
    return [functools.partial(copy, src[a:b], dst[a:b], sizes[a:b]) for a, b in zip(bounds, bounds[1:])]


class WindowTooShort(RuntimeError):
    """The copies ended within one compute step."""


class ComputeLoop:
    """One workload's step as a CUDA graph on its own stream."""

    def __init__(self, torch, workload: str, device="cuda"):
        if workload not in WORKLOADS:
            raise ValueError(f"workload: expected one of {WORKLOADS}, got {workload!r}")
        self.torch, self.workload = torch, workload
        self.stream = torch.cuda.Stream(device)
        # The step (and the tensors it closes over) lives as long as its graph.
        self._step = step = (_model_step if workload == "model" else _gemm_step)(torch, device)
        with torch.cuda.stream(self.stream):
            step()  # warm-up outside capture (library handles, autotuning)
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            step()
        self.step_seconds = self._steps(5)[-1]

    def _events(self, steps: int):
        """Per step, an event before it and one after it."""
        return [tuple(self.torch.cuda.Event(enable_timing=True) for _ in range(2)) for _ in range(steps)]

    def _replay(self, events, first: int, stop: int, late: list[int], ahead: int = AHEAD,
                wait: bool = True) -> int:
        """Steps [first, stop), each between its events, at most ``ahead`` ahead of the GPU;
        without ``wait``, only those that need no wait. Appends to ``late`` the steps
        enqueued after the GPU had finished the step before; returns the next step."""
        torch = self.torch
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            for i in range(first, stop):
                if i >= ahead:
                    if not wait and not events[i - ahead][1].query():
                        return i
                    _wait(events[i - ahead][1])
                if i and events[i - 1][1].query():
                    late.append(i)
                before, after = events[i]
                before.record(self.stream)
                self.graph.replay()
                after.record(self.stream)
        return stop

    def _steps(self, steps: int) -> list[float]:
        events = self._events(steps)
        self._replay(events, 0, steps, [], ahead=steps)
        events[-1][1].synchronize()
        return _periods(events)

    def beside(self, copy_stream, enqueue_copies, moved_bytes: int,
               expected_seconds: float) -> Beside | None:
        """Runs ``enqueue_copies`` (a function, or a list of them called in turn, which
        enqueue ``moved_bytes`` of copies on copy_stream, back to back) while the loop
        runs, and again the loop alone. Between two functions the loop is fed the steps
        it can take: copies whose host enqueueing is slow keep it fed if given in pieces
        (in_pieces). None if no loop long enough covered the copies."""
        pieces = [enqueue_copies] if callable(enqueue_copies) else list(enqueue_copies)
        torch = self.torch
        warm = WARM_STEPS[self.workload]
        for cover in (3, 8, 20):
            steps = warm + int(cover * expected_seconds / self.step_seconds) + 4
            # The idle loop runs before and after the busy one: their mean cancels a slow
            # drift of clocks between runs.
            idle_before = self._steps(steps)
            torch.cuda.synchronize()
            events = self._events(steps)
            late = []
            fed = self._replay(events, 0, min(steps, warm + AHEAD), late)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            copy_stream.wait_event(events[warm][0])
            start.record(copy_stream)
            try:
                for piece in pieces:
                    piece()
                    fed = self._replay(events, fed, steps, late, wait=False)
            finally:
                end.record(copy_stream)
                self._replay(events, fed, steps, late)
            torch.cuda.synchronize()
            if events[-1][1].elapsed_time(end) <= 0:  # the loop outlasted the copies
                break
        else:
            return None  # the copies outlasted 20 times their time alone
        idle_after = self._steps(steps)
        window = start.elapsed_time(end) / 1e3
        inside = [i for i, (before, after) in enumerate(events)
                  if start.elapsed_time(before) >= 0 and after.elapsed_time(end) >= 0]
        if not inside:
            raise WindowTooShort(f"no compute step lies inside the copy window of {window * 1e3:.2f} ms "
                                 f"(a step takes {self.step_seconds * 1e3:.2f} ms); move more bytes")
        times = _periods(events)
        times = [times[i] for i in inside]
        dry = len({i - 1 for i in late} & set(inside))  # periods that hold a wait for the host
        idle_times = [(idle_before[i] + idle_after[i]) / 2 for i in inside]
        step, idle_step = sum(times) / len(times), sum(idle_times) / len(idle_times)
        drift = (sum(idle_after[i] for i in inside) - sum(idle_before[i] for i in inside)) / sum(idle_times)
        return Beside(moved_bytes / window / 1e9, step / idle_step - 1, len(inside), step, idle_step,
                      drift, dry)
