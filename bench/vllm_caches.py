"""KV caches and block ids as vLLM 0.33 hands them to an offloading worker, made by
vLLM's own code:

- ``canonical_caches``: its planner's KVCacheConfig (get_kv_cache_config_from_groups),
  its allocate_kv_cache (every layer in one backing allocation, in the layout asked for)
  and its OffloadingConnectorWorker.register_kv_caches, which makes the
  CanonicalKVCaches a worker gets. ``per_layer`` keeps one allocation a layer, as vLLM
  before 0.32 made them.
- ``pool_jobs``: GPU block ids from its BlockPool and CPU chunk ids from its
  CPUOffloadingManager, under a trace of requests that arrive, grow and finish.

The engine config is a stand-in holding only the fields those functions read.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from types import SimpleNamespace as NS

import numpy as np

import vllm_env  # noqa: F401  (puts vLLM on sys.path)

if importlib.util.find_spec("einops") is None:  # imported by vllm.v1.worker.utils, unused here
    sys.modules["einops"] = types.ModuleType("einops")

KV_LAYOUTS = ("LBHNC", "BLHNC", "LBNHC", "per_layer")

# name -> (groups as (attention kind, layers), tokens a block, KV heads, head size); bf16.
MODELS = {
    "llama8b-64k": ([("full", 32)], 16, 8, 128),  # 64 KiB pages
    "tp8-8k": ([("full", 80)], 16, 1, 128),       # Llama-70B's layers at TP 8: 8 KiB
    "4k": ([("full", 64)], 16, 1, 64),
    "16k": ([("full", 64)], 16, 2, 128),
    "hybrid": ([("full", 16), ("sliding", 16)], 16, 4, 128),  # 32 KiB, the groups interleaved
    "mla-16": ([("mla", 61)], 16, 1, 576),        # DeepSeek's 576-element latent: 18 KiB
    "mla-64": ([("mla", 61)], 64, 1, 576),        # 72 KiB
}


# model -> (blocks a job, GPU blocks) in bench/vllm_worker.py; as many CPU chunks as GPU blocks.
JOBS = {"llama8b-64k": (256, 2048), "tp8-8k": (1024, 8192), "4k": (1024, 8192), "16k": (1024, 4096),
        "hybrid": (256, 4096), "mla-16": (256, 2048), "mla-64": (64, 512)}


def bench_pool_args(groups, n, blocks, half=None, count=8):
    """pool_jobs' arguments for the benchmark's jobs of n blocks a group over ``blocks``
    blocks, or over half of them (both ways at once: half 0 stores, half 1 loads)."""
    span = blocks if half is None else blocks // 2
    return (7 + (half or 0), span, span, n, count, groups)


def saved_calls():
    """The pool_jobs calls of the benchmark and tests/vllm/vllm_caches_test.py, which
    tools/stage_vllm_bundle.sh saves for the GPU hosts."""
    calls = [(0, 4096, 2048, 64, 12, 2, 400)] + [(11, 96, 96, 8, 4, g, 20) for g in (1, 2)]
    for model, (n, blocks) in JOBS.items():
        for half in (None, 0, 1):
            calls.append(bench_pool_args(len(MODELS[model][0]), n, blocks, half) + (400,))
    return calls


def _specs(torch, model):
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)
    groups, block, heads, head = MODELS[model]
    make = {"full": lambda: FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head,
                                              dtype=torch.bfloat16),
            "sliding": lambda: SlidingWindowSpec(block_size=block, num_kv_heads=heads, head_size=head,
                                                 dtype=torch.bfloat16, sliding_window=4 * block),
            "mla": lambda: MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=head,
                                            dtype=torch.bfloat16)}
    layers = sum(n for _, n in groups)
    # Groups take every len(groups)-th layer, as a hybrid model's alternate.
    return [KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(g, layers, len(groups))], make[kind]())
            for g, (kind, _) in enumerate(groups)]


def _engine(layout, heads):
    return NS(cache_config=NS(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=None,
                              prefix_cache_retention_interval=None),
              attention_config=NS(hisparse_config=None),
              parallel_config=NS(tensor_parallel_size=1, prefill_context_parallel_size=1, world_size=1,
                                 decode_context_parallel_size=1, cp_kv_cache_interleave_size=1, rank=0),
              model_config=NS(get_total_num_kv_heads=lambda: heads))


class _Spec:
    """The offloading spec as register_kv_caches sees it: get_worker keeps the caches."""

    replicated_layout = False
    config = NS(canonical_layout=False, parallel=NS(rank=0))
    caches = None

    def get_worker(self, caches):
        self.caches = caches
        return object()


def page_bytes(torch, model) -> int:
    return _specs(torch, model)[0].kv_cache_spec.page_size_bytes


def vllms_code_runs() -> bool:
    """Whether vLLM's allocation and connector code imports here: the GPU hosts' light
    bundle lacks what its engine config imports (transformers), and there the copy runs."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: F401
        from vllm.v1.worker.utils import allocate_kv_cache  # noqa: F401
    except ImportError:
        return False
    return True


def canonical_caches(torch, model: str, kv_layout: str, num_blocks: int, device, seed: int = 0,
                     builder: str = "auto"):
    """(CanonicalKVCaches, backing tensors, vLLM's KVCacheTensor or None) for ``model``'s
    cache of ``num_blocks`` blocks laid out as ``kv_layout`` (one of KV_LAYOUTS) on
    ``device``, filled with random bytes. Layer l of block b starts at byte
    ``offset + l * layer_stride + b * block_stride`` of the backing tensor. builder:
    ``vllm`` (its own code), ``copy`` (copy_of_vllm, which tests/vllm/vllm_caches_test.py
    holds against it), or ``auto``: vLLM's where it imports."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    groups = _specs(torch, model)
    page = groups[0].kv_cache_spec.page_size_bytes
    layers = sum(len(g.layer_names) for g in groups)
    gen = torch.Generator(device=device).manual_seed(seed)
    fill = lambda t: t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8, device=device, generator=gen))
    if kv_layout == "per_layer" or builder == "copy" or (builder == "auto" and not vllms_code_runs()):
        return copy_of_vllm(torch, groups, kv_layout, num_blocks, device, fill)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = KVCacheLayout[kv_layout]
    engine = _engine(layout, MODELS[model][2])
    config = get_kv_cache_config_from_groups(engine, groups, page * layers * num_blocks // len(groups))
    if config.num_blocks != num_blocks:
        raise AssertionError(f"vLLM's planner made {config.num_blocks} blocks, not {num_blocks}")
    views = allocate_kv_cache(config, torch.device(device), layout)
    backing = torch.tensor([], dtype=torch.int8, device=device).set_(next(iter(views.values())).untyped_storage())
    fill(backing)
    spec = _Spec()
    OffloadingConnectorWorker(spec, engine, config).register_kv_caches(views)
    return spec.caches, [backing], config.kv_cache_tensors[0]


def copy_of_vllm(torch, groups, kv_layout, num_blocks, device, fill):
    """What canonical_caches makes with vLLM's code, for models whose groups have one page
    size and as many layers each (vLLM then overlays layer k of every group on one run of
    bytes): one backing allocation; under LBHNC and LBNHC a [blocks, page] tensor a layer,
    num_blocks * page apart, each group's refs those tensors; under BLHNC one packed
    tensor whose page is a block across every layer, each group's one ref to it.
    per_layer: a tensor a layer, each its own allocation (vLLM before 0.32)."""
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    page = groups[0].kv_cache_spec.page_size_bytes
    per_group = len(groups[0].layer_names)
    if kv_layout == "per_layer":
        backing = [fill(torch.empty(num_blocks, page, dtype=torch.int8, device=device)) for _ in range(per_group)]
        tensors = backing
    else:
        backing = [fill(torch.empty(per_group * num_blocks * page, dtype=torch.int8, device=device))]
    if kv_layout == "BLHNC":
        tensors = [backing[0].view(num_blocks, per_group * page)]
        return (CanonicalKVCaches([CanonicalKVCacheTensor(tensors[0], per_group * page)],
                                  [[CanonicalKVCacheRef(0, per_group * page)] for _ in groups]), backing, None)
    if kv_layout != "per_layer":
        tensors = [backing[0][k * num_blocks * page:(k + 1) * num_blocks * page].view(num_blocks, page)
                   for k in range(per_group)]
    return (CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                              [[CanonicalKVCacheRef(k, page) for k in range(per_group)] for _ in groups]),
            backing, None)


# Where pool_jobs finds ids saved by save_pool_jobs, for hosts whose vLLM cannot import its
# block pool (the light bundle lacks what vllm.config imports).
SAVED_IDS = os.environ.get("KVOFFLOAD_VLLM_POOL_IDS", "")


def pool_jobs(seed: int, num_gpu_blocks: int, num_chunks: int, blocks_per_job: int, count: int,
              groups: int = 1, warm_requests: int = 400):
    """``count`` jobs of ``blocks_per_job`` blocks a group as a running engine hands them
    out: (GPU ids, CPU chunk ids) per job. Requests arrive while the pool has room (each
    of at most 64 blocks and a quarter of it) and finish at random (their blocks freed
    tail first, as vLLM frees them); after ``warm_requests`` of them a job is the blocks
    of newly admitted requests, its chunks those the CPU manager gives a store of as many
    new keys. Groups draw their ids from one pool, as vLLM's do. From SAVED_IDS where it
    holds these arguments' jobs."""
    # A job of up to half the pool is gathered while requests come and go; more may never be.
    most = min(num_gpu_blocks // 2, num_chunks)
    if num_gpu_blocks < 4 or not 0 < blocks_per_job * groups <= most:
        raise ValueError(f"blocks_per_job: {blocks_per_job} a group x {groups} groups must be in [1, {most}] "
                         f"(half of num_gpu_blocks={num_gpu_blocks}, at most num_chunks={num_chunks}, "
                         "with num_gpu_blocks >= 4)")
    key = f"{seed} {num_gpu_blocks} {num_chunks} {blocks_per_job} {count} {groups} {warm_requests}"
    if SAVED_IDS:
        with np.load(SAVED_IDS) as saved:
            if f"{key} gpu 0" in saved:
                return [(saved[f"{key} gpu {i}"], saved[f"{key} cpu {i}"]) for i in range(count)]
    return _pool_jobs(np.random.default_rng(seed), num_gpu_blocks, num_chunks, blocks_per_job, count, groups,
                      warm_requests)


def save_pool_jobs(path: str, calls) -> None:
    """pool_jobs(*args) for every args of ``calls``, run here, saved at ``path``."""
    arrays = {}
    for args in calls:
        key = " ".join(str(a) for a in args)
        for i, (gpu, cpu) in enumerate(pool_jobs(*args)):
            arrays[f"{key} gpu {i}"], arrays[f"{key} cpu {i}"] = gpu, cpu
    np.savez_compressed(path, **arrays)


def _pool_jobs(rng, num_gpu_blocks, num_chunks, blocks_per_job, count, groups, warm_requests):
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    pool = BlockPool(num_gpu_blocks=num_gpu_blocks, enable_caching=False, hash_block_size=16)
    manager = CPUOffloadingManager(num_chunks=num_chunks)
    context = ReqContext(req_id="trace")
    live, jobs, key, admitted, pending = [], [], 0, 0, []
    need = blocks_per_job * groups
    while len(jobs) < count:
        size = int(rng.integers(1, min(64, num_gpu_blocks // 4) + 1))
        while live and (pool.get_num_free_blocks() < size + 1 or rng.random() < 0.3):
            done = live.pop(int(rng.integers(len(live))))
            pool.free_blocks(reversed(done))
            freed = {b.block_id for b in done}
            pending = [i for i in pending if i not in freed]  # a finished request stores nothing more
        blocks = pool.get_new_blocks(size)
        live.append(blocks)
        admitted += 1
        if admitted <= warm_requests:
            continue
        pending += [b.block_id for b in blocks]
        if len(pending) < need:
            continue
        gpu = np.array(pending[:need], dtype=np.int64)
        pending = []
        keys = [make_offload_key(k.to_bytes(8, "big"), 0) for k in range(key, key + need)]
        key += need
        store = manager.prepare_store(keys, context)
        manager.complete_store(keys, context)
        jobs.append((gpu, np.asarray(store.store_spec.block_ids, dtype=np.int64)))
    return jobs


def run_lengths(gpu, cpu=None) -> dict[str, float]:
    """Mean run lengths of a job's ids: ``gpu``, runs of neighbouring GPU ids, up or
    down; ``both``, with ``cpu``, runs whose GPU and CPU ids both go up by one (what one
    copy per run can move)."""
    gpu = np.asarray(gpu)
    if gpu.size == 0:
        return {"gpu": 0.0, "both": 0.0}
    runs, going = 1, 0  # going: the step of the run in hand, 0 after a break
    for step in np.diff(gpu).tolist():
        if abs(step) == 1 and going in (0, step):
            going = step
        else:
            runs, going = runs + 1, 0
    out = {"gpu": gpu.size / runs}
    if cpu is not None:
        both = (np.diff(gpu) == 1) & (np.diff(np.asarray(cpu)) == 1)
        out["both"] = gpu.size / (1 + int(np.count_nonzero(~both)))
    return out


if __name__ == "__main__":
    save_pool_jobs(sys.argv[1], saved_calls())
    print(f"saved vLLM block pool ids of {len(saved_calls())} calls at {sys.argv[1]}")
