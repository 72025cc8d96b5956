"""The model that kvoffload.meter runs beside copies: one step captured as a CUDA graph, so
that the host enqueues a step in microseconds.

Workloads:
- ``model``: MODEL_LAYERS Llama-3.1-8B-shaped prefill layers (4096 tokens, 32 query / 8
  KV heads of 128, MLP 14336, RMSNorm, causal SDPA, bf16, random weights);
- ``decode``: DECODE_LAYERS Llama-3.1-8B-shaped decode layers (64 sequences of 2048
  tokens of KV cache each, bf16): bound by HBM, as a server's decode steps are. The
  layers share one KV cache (537 MB) and one set of weights, each far larger than L2;
- ``gemm``: bf16 8192^3 matrix products, four per step.

On the H200 the ``model`` loop runs at the board's power limit, where the clocks wander
with the power controller; ``decode`` stays under it (docs/measuring.md).
"""

from __future__ import annotations

WORKLOADS = ("model", "decode", "gemm")
MODEL_LAYERS = 4  # a model step: enough layers that a step's launch is a small part of it
DECODE_LAYERS = 8  # one KV cache and one set of weights, read by every layer


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


def _decode_step(torch, device):
    seqs, context, hidden, heads, kv_heads, head_dim, mlp = 64, 2048, 4096, 32, 8, 128, 14336
    bf16 = dict(dtype=torch.bfloat16, device=device)
    scale = hidden ** -0.5
    w = {name: torch.randn(shape, **bf16) * scale for name, shape in {
        "qkv": (hidden, (heads + 2 * kv_heads) * head_dim), "o": (heads * head_dim, hidden),
        "gate_up": (hidden, 2 * mlp), "down": (mlp, hidden)}.items()}
    norm = torch.ones(hidden, **bf16)
    k = torch.randn(seqs, kv_heads, context, head_dim, **bf16)
    v = torch.randn(seqs, kv_heads, context, head_dim, **bf16)
    x = torch.randn(seqs, hidden, **bf16)
    F = torch.nn.functional

    def layer():
        h = F.rms_norm(x, (hidden,), norm)
        q = (h @ w["qkv"])[:, :heads * head_dim].view(seqs, heads, 1, head_dim)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        h = x + a.reshape(seqs, heads * head_dim) @ w["o"]
        gate_up = F.rms_norm(h, (hidden,), norm) @ w["gate_up"]
        return h + (F.silu(gate_up[:, :mlp]) * gate_up[:, mlp:]) @ w["down"]

    return lambda: [layer() for _ in range(DECODE_LAYERS)]


def _gemm_step(torch, device):
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    return lambda: [torch.mm(a, b) for _ in range(4)]


class ComputeLoop:
    """One workload's step as a CUDA graph on its own stream."""

    def __init__(self, torch, workload: str, device="cuda"):
        if workload not in WORKLOADS:
            raise ValueError(f"workload: expected one of {WORKLOADS}, got {workload!r}")
        self.torch, self.workload = torch, workload
        self.stream = torch.cuda.Stream(device)
        # The step (and the tensors it closes over) lives as long as its graph.
        steps = {"model": _model_step, "decode": _decode_step, "gemm": _gemm_step}
        self._step = step = steps[workload](torch, device)
        with torch.cuda.stream(self.stream):
            step()  # warm-up outside capture (library handles, autotuning)
        self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            step()
        self.step_seconds = self._steps(5)[-1]

    def _steps(self, steps: int) -> list[float]:
        """Seconds of each of ``steps`` steps run back to back, from its start to the next's."""
        torch = self.torch
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            events[0].record(self.stream)
            for event in events[1:]:
                self.graph.replay()
                event.record(self.stream)
        events[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
