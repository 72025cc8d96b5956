"""kvoffload.vllm's worker driven through vLLM's classes (GPULoadStoreSpec,
CPULoadStoreSpec, CanonicalKVCaches), as vLLM's connector drives it.

  bazel run //bench:vllm_worker -- --out=bench/results/vllm_worker_<gpu>.json

Caches as vLLM hands them over: Llama-3.1-8B (64 tensors of 32 KiB pages, one group) and
a hybrid of two groups sharing 32 tensors of 32 KiB rows (full attention moving 32 KiB,
sliding window 16 KiB per block). Jobs move random blocks to random chunks: stores, loads,
and both at once (disjoint halves), with the worker's default method (pages) and with
kvoffload's batch path (cuMemcpyBatchAsync, what vLLM's own worker does); --interference
repeats them beside the compute loops of kvoffload.compute_loop. Without a GPU it
runs the host path on a small cache and says so. Rows go under "rows" in the JSON.
"""

import datetime
import json
import os
import time

from kvoffload import compute_loop
import numpy as np
import vllm_env  # noqa: F401  (puts vLLM on sys.path)
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("job_blocks", ["32", "512"], "Blocks per job and group.")
flags.DEFINE_integer("gpu_blocks", 2048, "GPU blocks per tensor.")
flags.DEFINE_integer("blocks_per_chunk", 16, "Blocks per CPU chunk.")
flags.DEFINE_integer("moved_mib", 4096, "Bytes moved per measurement, MiB.")
flags.DEFINE_list("methods", ["pages", "batch"], "Worker copy methods (the handler's).")
flags.DEFINE_list("interference", ["model"], "Compute loops (model, gemm; kvoffload.compute_loop) "
                  "beside which to also run the jobs, reporting the step slowdown.")
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")

KIB = 1024
# name -> (row bytes per tensor, [[(tensor index, unpadded page)] per group])
CACHES = {
    "llama3.1-8b": ([32 * KIB] * 64, [[(t, 32 * KIB) for t in range(64)]]),
    "hybrid-2-groups": ([32 * KIB] * 32, [[(t, 32 * KIB) for t in range(32)],
                                          [(t, 16 * KIB) for t in range(32)]]),
}


def vllm_cache(torch, rows, refs, blocks, device):
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
    return CanonicalKVCaches(
        [CanonicalKVCacheTensor(torch.zeros((blocks, row), dtype=torch.int8, device=device), row)
         for row in rows], [[CanonicalKVCacheRef(t, page) for t, page in group] for group in refs])


def jobs(rng, groups, n, blocks, chunks, bpc, count, half=None):
    """count jobs of n random blocks per group (ids unique across groups, as vLLM's block
    pool gives them); half 0 or 1 keeps to that half of the blocks and chunks."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    lo_b, lo_c = (0, 0) if half is None else (half * blocks // 2, half * chunks // 2)
    span_b, span_c = (blocks, chunks) if half is None else (blocks // 2, chunks // 2)
    used = -(-n // bpc)
    out = []
    for _ in range(count):
        ids = lo_b + rng.permutation(span_b)[:groups * n]
        cids = lo_c + rng.permutation(span_c)[:groups * used]
        out.append((GPULoadStoreSpec(ids.tolist(), [n] * groups, [0] * groups),
                    CPULoadStoreSpec(cids.tolist())))
    return out


def submit(worker, batches, first_id):
    """Submits [(direction, specs)] interleaved, back to back; returns the job ids."""
    job_id, ids = first_id, set()
    for i in range(max(len(specs) for _, specs in batches)):
        for direction, specs in batches:
            if i < len(specs):
                gpu, cpu = specs[i]
                ok = (worker.submit_store(job_id, gpu, cpu) if direction == "store"
                      else worker.submit_load(job_id, cpu, gpu))
                assert ok
                ids.add(job_id)
                job_id += 1
    return ids


def collect(worker, ids):
    """Waits for the jobs; the bytes they moved."""
    worker.wait(ids)
    results = worker.get_finished()
    assert {r.job_id for r in results} == ids and all(r.success for r in results)
    return sum(r.transfer_size for r in results)


def run(torch, worker, batches, first_id):
    """The jobs back to back, alone: (wall seconds, bytes)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    ids = submit(worker, batches, first_id)
    nbytes = collect(worker, ids)
    return time.perf_counter() - start, nbytes


def beside(torch, loop, worker, batches, first_id, nbytes, alone_seconds):
    """The jobs while ``loop`` (kvoffload.compute_loop) runs; the current stream marks
    their window, waiting for them through the handler's fence."""
    ids = set()

    def enqueue():
        ids.update(submit(worker, batches, first_id))
        worker.handler.fence()

    got = loop.beside(torch.cuda.current_stream(), enqueue, nbytes, alone_seconds)
    collect(worker, ids)
    return got


def main(argv):
    del argv
    import torch

    from kvoffload.vllm import KVOffloadWorker

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    blocks = FLAGS.gpu_blocks if gpu else 128
    moved = (FLAGS.moved_mib if gpu else 64) << 20
    bpc = FLAGS.blocks_per_chunk
    if not gpu:
        print("no GPU: running the host path on a small cache, not the PCIe link")
    rng = np.random.default_rng(0)
    loops = {w: compute_loop.ComputeLoop(torch, w) for w in FLAGS.interference} if gpu else {}
    rows, next_id = [], 0
    for name, (row_bytes, refs) in CACHES.items():
        kv_caches = vllm_cache(torch, row_bytes, refs, blocks, device)
        groups = len(refs)
        for method in FLAGS.methods if gpu else ["host"]:
            worker = KVOffloadWorker(kv_caches, bpc, blocks // bpc,
                                     **({"method": method} if gpu else {}))
            for n in sorted({min(int(b), blocks // (2 * groups)) for b in FLAGS.job_blocks}):
                job_bytes = n * sum(page for group in refs for _, page in group)
                count = max(2, moved // job_bytes)
                run(torch, worker, [("store", jobs(rng, groups, n, blocks, blocks // bpc, bpc, 1))],
                    next_id)  # warm up
                next_id += 1
                for direction in ("store", "load", "both"):
                    if direction == "both":
                        batches = [(d, jobs(rng, groups, n, blocks, blocks // bpc, bpc, count // 2, half=h))
                                   for h, d in enumerate(("store", "load"))]
                    else:
                        batches = [(direction, jobs(rng, groups, n, blocks, blocks // bpc, bpc, count))]
                    wall, nbytes = run(torch, worker, batches, next_id)
                    next_id += sum(len(s) for _, s in batches)
                    row = dict(cache=name, method=method, direction=direction,
                               block_bytes=max(page for group in refs for _, page in group),
                               blocks_per_job=n, job_mib=job_bytes / 2**20, jobs=sum(len(s) for _, s in batches),
                               gb_per_s=nbytes / wall / 1e9)
                    rows.append(row)
                    print(f"{name:<16} {method:<6} {direction:<6} {n:>4} blocks/job "
                          f"({job_bytes / 2**20:.0f} MiB) {row['gb_per_s']:6.1f} GB/s")
                    for workload, loop in loops.items():
                        got = beside(torch, loop, worker, batches, next_id, nbytes, wall)
                        next_id += sum(len(s) for _, s in batches)
                        if got is None:
                            continue
                        rows.append(dict(row, workload=workload, gb_per_s_beside=got.gb_per_s,
                                         step_slowdown=got.step_slowdown, idle_drift=got.idle_drift,
                                         steps_in_window=got.steps_in_window, dry_steps=got.dry_steps))
                        print(f"  beside {workload}: {got.summary()}")
            worker.shutdown()
        del kv_caches
    if FLAGS.out:
        path = os.path.join(os.environ.get("BUILD_WORKSPACE_DIRECTORY", "."), FLAGS.out)
        meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                    device=torch.cuda.get_device_name() if gpu else "cpu", blocks_per_chunk=bpc,
                    gpu_blocks=blocks, moved_mib=moved >> 20,
                    note="workload: the jobs beside a compute loop (kvoffload.compute_loop), step "
                         "slowdown against the same sustained loop beside an idle stream. batch = "
                         "cuMemcpyBatchAsync, vLLM's own worker's path.")
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
