"""Offload benchmark: store and load jobs through OffloadHandler on realistic KV caches,
against the bulk copy (the link's limit) measured in the same run.

  bazel run //bench:offload -- --out=bench/results/offload_<gpu>.json

Caches: Llama-3.1-8B (32 layers x K/V, 8 KV heads, head dim 128, bf16, 16-token blocks:
64 tensors of 32 KiB pages) and a hybrid of two groups (16 full-attention layers with
32 KiB pages, 16 sliding-window layers with 16 KiB pages). Jobs move random GPU blocks
to random CPU chunks of the handler's chunk-major pool and back. Without a GPU it runs
the host path on a small cache and says so.
"""

import datetime
import itertools
import json
import os
import time

import numpy as np
from absl import app, flags

import kvoffload as kv
from kvoffload import auto
from kvoffload.handler import OffloadHandler
from kvoffload.planner import CPUSpec, GPUSpec, chunks_used

FLAGS = flags.FLAGS
flags.DEFINE_list("job_blocks", ["32", "128", "512"], "Blocks per job (16 tokens each).")
flags.DEFINE_integer("gpu_blocks", 2048, "GPU blocks per tensor.")
flags.DEFINE_integer("blocks_per_chunk", 16, "Blocks per CPU chunk.")
flags.DEFINE_integer("moved_mib", 4096, "Bytes moved per measurement and direction, MiB.")
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")
flags.DEFINE_list("methods", ["auto", "batch"], "Handler copy methods to compare (kvoffload.auto).")

# name -> [(layers, kv heads, head dim)] per group; K and V are separate tensors.
CACHES = {
    "llama3.1-8b": [(32, 8, 128)],
    "hybrid-2-groups": [(16, 8, 128), (16, 4, 128)],
}
TOKENS_PER_BLOCK = 16


def make_cache(torch, shape, blocks, device):
    return [[torch.empty((blocks, TOKENS_PER_BLOCK, heads, dim), dtype=torch.bfloat16, device=device)
             for _ in range(2 * layers)] for layers, heads, dim in shape]


def job_specs(rng, groups, n, blocks, chunks, bpc):
    first = int(rng.integers(0, bpc))
    used = chunks_used(n, first, bpc)
    ids = np.concatenate([rng.permutation(blocks)[:n] for _ in range(groups)])
    chunk_ids = np.concatenate([rng.permutation(chunks)[:used] for _ in range(groups)])
    return GPUSpec(ids, [n] * groups, [first] * groups), CPUSpec(chunk_ids)


def run_jobs(torch, handler, specs, direction):
    """Submits every job back to back; (wall seconds, bytes, per-job event seconds)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i, (gpu, cpu) in enumerate(specs):
        handler.transfer_async((direction, i), *((gpu, cpu) if direction == "store" else (cpu, gpu)))
    handler.wait([(direction, i) for i in range(len(specs))])
    wall = time.perf_counter() - start
    results = handler.get_finished()
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    return wall, sum(r.bytes for r in results), [r.seconds for r in results]


def bulk_seconds(torch, nbytes):
    """One copy of nbytes each way between a pinned host buffer and the GPU."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    out = {}
    for direction, (src, dst) in {"load": (host, dev), "store": (dev, host)}.items():
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            kv.batch_copy([src.data_ptr()], [dst.data_ptr()], [nbytes], stream, per_copy=True, registry=kv.UNCHECKED)
            stream.synchronize()
            best = min(best, time.perf_counter() - start)
        out[direction] = best
    return out


def main(argv):
    del argv
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        torch, gpu = None, False
    rng = np.random.default_rng(0)
    bpc = FLAGS.blocks_per_chunk
    blocks = FLAGS.gpu_blocks if gpu else 256
    moved = (FLAGS.moved_mib if gpu else 64) << 20
    if not gpu:
        print("no GPU: running the host path on a small cache, not the PCIe link")
    bulk = bulk_seconds(torch, 1 << 30) if gpu else None
    if bulk:
        print(f"bulk copy of 1 GiB: load {(1 << 30) / bulk['load'] / 1e9:.1f} GB/s, "
              f"store {(1 << 30) / bulk['store'] / 1e9:.1f} GB/s")
    rows = []
    for name, shape in CACHES.items():
        cache = make_cache(torch, shape, blocks, "cuda" if gpu else "cpu")
        handlers = {}
        chunks = blocks // bpc
        block_bytes = sum(2 * layers * TOKENS_PER_BLOCK * heads * dim * 2 for layers, heads, dim in shape)
        for method, n in itertools.product(FLAGS.methods if gpu else ["host"],
                                           sorted({min(int(b), blocks // 2) for b in FLAGS.job_blocks})):
            handler = handlers.get(method) or handlers.setdefault(
                method, OffloadHandler(cache, chunks, bpc, method=method if gpu else "auto"))
            jobs = max(2, moved // (n * block_bytes))
            specs = [job_specs(rng, len(shape), n, blocks, chunks, bpc) for _ in range(jobs)]
            for direction in ("store", "load"):
                run_jobs(torch, handler, specs[:1], direction)  # warm up
                wall, nbytes, seconds = run_jobs(torch, handler, specs, direction)
                row = dict(cache=name, method=method, direction=direction, blocks_per_job=n, jobs=jobs,
                           job_mib=nbytes / jobs / 2**20, gb_per_s=nbytes / wall / 1e9,
                           median_job_seconds=float(np.median(seconds)))
                if bulk:
                    row["ratio_to_bulk"] = (nbytes / wall) / ((1 << 30) / bulk[direction])
                rows.append(row)
                ratio = f"  {row['ratio_to_bulk']:.0%} of bulk" if bulk else ""
                print(f"{name:<16} {method:<7} {direction:<5} {n:>4} blocks/job ({row['job_mib']:.0f} MiB) "
                      f"x{jobs:<4} {row['gb_per_s']:6.1f} GB/s{ratio}")
        for handler in handlers.values():
            handler.shutdown()
        del cache
    if FLAGS.out:
        out = FLAGS.out
        if not os.path.isabs(out) and "BUILD_WORKSPACE_DIRECTORY" in os.environ:
            out = os.path.join(os.environ["BUILD_WORKSPACE_DIRECTORY"], out)
        machine = dict(device=torch.cuda.get_device_name() if gpu else "none (host path)")
        if bulk:
            machine["bulk_gb_per_s"] = {d: (1 << 30) / s / 1e9 for d, s in bulk.items()}
        with open(out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), machine=machine,
                           config=dict(gpu_blocks=blocks, blocks_per_chunk=bpc, cpu_layout="chunk_major",
                                       calibration=auto.calibration().rates if gpu else None,
                                       moved_mib=moved >> 20),
                           results=rows), f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
