"""Offload benchmark: store and load jobs through OffloadHandler on realistic KV caches,
against the bulk copy (the link's limit) measured in the same run.

  bazel run //bench:offload -- --out=bench/results/offload_<gpu>.json

Caches: Llama-3.1-8B (32 layers x K/V, 8 KV heads, head dim 128, bf16, 16-token blocks:
64 tensors of 32 KiB pages) and a hybrid of two groups (16 full-attention layers with
32 KiB pages, 16 sliding-window layers with 16 KiB pages). Jobs move random GPU blocks
to random CPU chunks of the handler's chunk-major pool and back. Without a GPU it runs
the host path on a small cache and says so.

--concurrent also runs stores and loads at once (disjoint blocks and chunks), the best of
three, against two bulk copies at once, one each way. --interference=model also keeps
each handler's stores and loads in flight beside the loop on kvoffload.meter, with bulk
copies beside it as the reference of the same run. --devices=0,1 runs one handler per GPU, both at
once, against bulk copies on both GPUs at once.
"""

import dataclasses
import functools
import itertools
import time

import numpy as np
from absl import app, flags

import kvoffload as kv
from kvoffload.costs import calibration
from kvoffload.jobs.handler import OffloadHandler
from kvoffload.meter import compute_loop, meter
from kvoffload.meter.sources import BulkCopies, HandlerAsWorker, WorkerCopies
from kvoffload.pages import paths as page_methods
from kvoffload.pages.planner import CPUSpec, GPUSpec, chunks_used

import common

FLAGS = flags.FLAGS
flags.DEFINE_list("job_blocks", ["32", "128", "512"], "Blocks per job (16 tokens each).")
flags.DEFINE_integer("gpu_blocks", 2048, "GPU blocks per tensor.")
flags.DEFINE_integer("blocks_per_chunk", 16, "Blocks per CPU chunk.")
flags.DEFINE_integer("moved_mib", 4096, "Bytes moved per measurement and direction, MiB.")
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")
flags.DEFINE_list("methods", ["auto", "batch"], "Handler copy methods to compare (kvoffload.costs.auto); "
                  "pages_ctasN and pages_kernel_ctasN are those methods with Pages(ctas=N).")
flags.DEFINE_bool("concurrent", False, "Also run stores and loads at once.")
flags.DEFINE_list("devices", [], "GPUs to run one handler each on, at once (e.g. 0,1).")
flags.DEFINE_list("interference", [], "Compute loops (model, decode, gemm; kvoffload.meter.compute_loop) beside "
                  "which to also run each method's stores and loads, reporting the step slowdown.")

# name -> [(layers, kv heads, head dim)] per group; K and V are separate tensors.
CACHES = {
    "llama3.1-8b": [(32, 8, 128)],
    "hybrid-2-groups": [(16, 8, 128), (16, 4, 128)],
}
TOKENS_PER_BLOCK = 16
CPU_LAYOUT = "chunk_major"  # every handler's, so that runs compare across files


def make_cache(torch, shape, blocks, device):
    return [[torch.empty((blocks, TOKENS_PER_BLOCK, heads, dim), dtype=torch.bfloat16, device=device)
             for _ in range(2 * layers)] for layers, heads, dim in shape]


def job_specs(rng, groups, n, blocks, chunks, bpc, half=None):
    """A job of n random blocks per group; half 0 or 1 keeps it to that half of the
    blocks and chunks (jobs in different halves share nothing)."""
    first = int(rng.integers(0, bpc))
    used = chunks_used(n, first, bpc)
    if half is not None:
        blocks, chunks = blocks // 2, chunks // 2
    block_base, chunk_base = (blocks * half, chunks * half) if half else (0, 0)
    ids = np.concatenate([common.random_ids(rng, n, blocks, block_base) for _ in range(groups)])
    chunk_ids = np.concatenate([common.random_ids(rng, used, chunks, chunk_base) for _ in range(groups)])
    return GPUSpec(ids, [n] * groups, [first] * groups), CPUSpec(chunk_ids)


def make_handler(cache, chunks, bpc, method):
    """An OffloadHandler for a --methods entry."""
    base, _, ctas = method.partition("_ctas")
    if ctas and base in page_methods.NAMES:
        return OffloadHandler(cache, chunks, bpc, method=dataclasses.replace(kv.Pages.named(base), ctas=int(ctas)),
                              cpu_layout=CPU_LAYOUT)
    return OffloadHandler(cache, chunks, bpc, method=method, cpu_layout=CPU_LAYOUT)


def submit(handler, specs, direction, first_id=0):
    """Submits the jobs with ids (direction, first_id + i); returns the ids."""
    ids = [(direction, first_id + i) for i in range(len(specs))]
    for job_id, (gpu, cpu) in zip(ids, specs):
        if direction == "store":
            handler.store(job_id, gpu, cpu)
        else:
            handler.load(job_id, cpu, gpu)
    return ids


def finish(handler, ids):
    """Waits for the jobs; (bytes, per-job event seconds)."""
    handler.wait(ids)
    results = handler.get_finished()
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    return sum(r.bytes for r in results), [r.seconds for r in results]


def run_jobs(torch, handler, specs, direction):
    """Submits every job back to back; (wall seconds, bytes, per-job event seconds)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    nbytes, seconds = finish(handler, submit(handler, specs, direction))
    return time.perf_counter() - start, nbytes, seconds


def run_at_once(torch, runs):
    """[(handler, specs, direction)] with submissions interleaved; (wall seconds, bytes)."""
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    ids = [[] for _ in runs]
    for i in range(max(len(specs) for _, specs, _ in runs)):
        for r, (handler, specs, direction) in enumerate(runs):
            if i < len(specs):
                ids[r] += submit(handler, specs[i : i + 1], direction, i)
    nbytes = sum(finish(handler, job_ids)[0] for (handler, _, _), job_ids in zip(runs, ids))
    return time.perf_counter() - start, nbytes


def concurrent_bulk_seconds(torch, copies):
    """Best wall time of [(src, dst, stream)] one-copy transfers run at once."""
    best = float("inf")
    for _ in range(3):
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        for src, dst, stream in copies:
            kv.batch_copy([src.data_ptr()], [dst.data_ptr()], [src.numel()], stream, per_copy=True,
                          registry=kv.UNCHECKED)
        for _, _, stream in copies:
            stream.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def bulk_pair(torch, nbytes, device="cuda"):
    return (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            torch.empty(nbytes, dtype=torch.uint8, device=device), torch.cuda.Stream(device))


def bulk_seconds(torch, nbytes):
    """One copy of nbytes each way between a pinned host buffer and the GPU."""
    host, dev, stream = bulk_pair(torch, nbytes)
    return {"load": concurrent_bulk_seconds(torch, [(host, dev, stream)]),
            "store": concurrent_bulk_seconds(torch, [(dev, host, stream)])}


def report(cache, method, direction, n, jobs, nbytes, wall, bulk_seconds_per_gib, **extra):
    """Prints and returns a result row; the ratio is to the bulk copy's rate."""
    row = dict(cache=cache, method=method, direction=direction, job=direction,
               blocks_per_job=n, jobs=jobs,
               job_mib=nbytes / jobs / 2**20, gb_per_s=nbytes / wall / 1e9, **extra)
    ratio = ""
    if bulk_seconds_per_gib:
        row["ratio_to_bulk"] = (nbytes / wall) / ((1 << 30) / bulk_seconds_per_gib)
        ratio = f"  {row['ratio_to_bulk']:.0%} of bulk"
    print(f"{cache:<16} {method:<7} {direction:<10} {n:>4} blocks/job ({row['job_mib']:.0f} MiB) "
          f"x{jobs:<4} {row['gb_per_s']:6.1f} GB/s{ratio}")
    return row


def submit_cost_row(torch, rng, bpc, method):
    """Host seconds inside store/load for a 1 GiB job of 4 KiB pages (one tensor of
    2^18 blocks, chunks of bpc blocks at random), median of 5: stores submitted alone, and
    stores and loads in turn with a job of the other lane in flight (its accesses are
    then recorded and this job's checked against them)."""
    blocks = 1 << 18
    cache = [[torch.empty((blocks, 4096), dtype=torch.uint8, device="cuda")]]
    handler = make_handler(cache, blocks // bpc, bpc, method)

    def timed_submit(job_id, load):
        gpu, cpu = GPUSpec(common.random_ids(rng, blocks, blocks), [blocks], [0]), CPUSpec(common.random_ids(rng, blocks // bpc, blocks // bpc))
        start = time.perf_counter()
        if load:
            handler.load(job_id, cpu, gpu)
        else:
            handler.store(job_id, gpu, cpu)
        return time.perf_counter() - start

    alone, busy = [], []
    for i in range(6):
        torch.cuda.synchronize()
        alone.append(timed_submit(("alone", i), load=False))
        handler.wait([("alone", i)])
    for i in range(7):
        busy.append(timed_submit(("busy", i), load=i % 2 == 1))
        if i:
            handler.wait([("busy", i - 1)])  # one job of the other lane stays in flight
    handler.wait([("busy", 6)])
    assert all(r.success for r in handler.get_finished())
    handler.shutdown()
    seconds, busy_seconds = float(np.median(alone[1:])), float(np.median(busy[2:]))
    print(f"host time to submit a 1 GiB job of 4 KiB pages ({method}): {seconds * 1e3:.2f} ms alone, "
          f"{busy_seconds * 1e3:.2f} ms with a job of the other lane in flight")
    return dict(cache="4KiB-pages-1GiB", method=method, direction="store", job="store", block_bytes=4096,
                submit_seconds=seconds, submit_seconds_busy=busy_seconds)


def multi_device_rows(torch, devices, rng, bpc, blocks, moved):
    """One Llama-3.1-8B handler per device, all storing (then loading) at once, against
    bulk copies on every device at once."""
    shape = CACHES["llama3.1-8b"]
    block_bytes = sum(2 * layers * TOKENS_PER_BLOCK * heads * dim * 2 for layers, heads, dim in shape)
    n, chunks = 512, blocks // bpc
    jobs = max(2, moved // (n * block_bytes))
    handlers = [OffloadHandler(make_cache(torch, shape, blocks, f"cuda:{d}"), chunks, bpc, cpu_layout=CPU_LAYOUT) for d in devices]
    pairs = [bulk_pair(torch, 1 << 30, f"cuda:{d}") for d in devices]
    rows = []
    for direction in ("store", "load"):
        copies = [(dev, host, s) if direction == "store" else (host, dev, s) for host, dev, s in pairs]
        per_gib = concurrent_bulk_seconds(torch, copies) / len(devices)
        print(f"bulk copies of 1 GiB on {len(devices)} GPUs at once, {direction}: "
              f"{(1 << 30) / per_gib / 1e9:.1f} GB/s together")
        runs = [(h, [job_specs(rng, 1, n, blocks, chunks, bpc) for _ in range(jobs)], direction) for h in handlers]
        run_at_once(torch, [(h, specs[:1], d) for h, specs, d in runs])  # warm up
        wall, nbytes = run_at_once(torch, runs)
        rows.append(report(f"llama x{len(devices)} GPUs", "auto", direction, n, jobs * len(devices), nbytes,
                           wall, per_gib, devices=devices))
    for h in handlers:
        h.shutdown()
    return rows


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
        (h1, d1, s1), (h2, d2, s2) = bulk_pair(torch, 1 << 30), bulk_pair(torch, 1 << 30)
        bulk["both"] = concurrent_bulk_seconds(torch, [(h1, d1, s1), (d2, h2, s2)]) / 2
        del h1, d1, h2, d2
        print(f"bulk copy of 1 GiB: load {(1 << 30) / bulk['load'] / 1e9:.1f} GB/s, "
              f"store {(1 << 30) / bulk['store'] / 1e9:.1f} GB/s, both at once "
              f"{(1 << 30) / bulk['both'] / 1e9:.1f} GB/s together")
    rows = []
    loops = {w: compute_loop.ComputeLoop(torch, w) for w in FLAGS.interference} if gpu else {}
    for name, shape in CACHES.items():
        cache = make_cache(torch, shape, blocks, "cuda" if gpu else "cpu")
        handlers = {}
        chunks = blocks // bpc
        block_bytes = sum(2 * layers * TOKENS_PER_BLOCK * heads * dim * 2 for layers, heads, dim in shape)
        page = TOKENS_PER_BLOCK * shape[0][1] * shape[0][2] * 2  # bytes per tensor of the first group
        for method, n in itertools.product(FLAGS.methods if gpu else ["host"],
                                           sorted({min(int(b), blocks // 2) for b in FLAGS.job_blocks})):
            handler = handlers.get(method) or handlers.setdefault(
                method, make_handler(cache, chunks, bpc, method if gpu else "auto"))
            jobs = max(2, moved // (n * block_bytes))
            specs = [job_specs(rng, len(shape), n, blocks, chunks, bpc) for _ in range(jobs)]
            alone = {}
            for direction in ("store", "load"):
                run_jobs(torch, handler, specs[:1], direction)  # warm up
                wall, nbytes, seconds = run_jobs(torch, handler, specs, direction)
                rows.append(report(name, method, direction, n, jobs, nbytes, wall,
                                   bulk[direction] if bulk else None, block_bytes=page,
                                   median_job_seconds=float(np.median(seconds))))
                alone[direction] = rows[-1]
            sources = {d: functools.partial(WorkerCopies, HandlerAsWorker(handler), {d: specs}, d)
                       for d in ("store", "load")}
            # Made once: their pinned buffers are not allocated inside a window.
            bulks = {d: BulkCopies(torch, d) for d in ("store", "load")} if loops else {}
            sources.update({f"bulk {d}": lambda b=b: b for d, b in bulks.items()})
            for workload, loop in loops.items():
                got = meter.measure(loop, sources)
                for direction, row in alone.items():
                    r, ref = got[direction], got[f"bulk {direction}"]
                    rows.append(dict(row, workload=workload, gb_per_s_beside=r.gb_per_s,
                                     step_slowdown=r.step_slowdown, bulk_step_slowdown=ref.step_slowdown,
                                     idle_drift=r.idle_drift, noisy=r.noisy, dry_steps=r.dry_steps))
                    print(f"  {direction} beside {workload}: {r.summary()}; bulk {ref.step_slowdown:+.2%}")
        if gpu and FLAGS.concurrent:
            n = max(min(int(b), blocks // 4) for b in FLAGS.job_blocks)
            jobs = max(2, moved // (n * block_bytes))
            for method, handler in handlers.items():
                runs = [(handler, [job_specs(rng, len(shape), n, blocks, chunks, bpc, half)
                                   for _ in range(jobs)], direction)
                        for half, direction in enumerate(("store", "load"))]
                run_at_once(torch, [(h, specs[:1], d) for h, specs, d in runs])  # warm up
                # The best of three, as for the bulk copies it is compared with.
                walls, nbytes = zip(*(run_at_once(torch, runs) for _ in range(3)))
                rows.append(report(name, method, "both", n, jobs, nbytes[0], min(walls), bulk["both"],
                                   block_bytes=page, trials=3,
                                   gb_per_s_trials=[nbytes[0] / w / 1e9 for w in walls]))
        for handler in handlers.values():
            handler.shutdown()
        del cache
    if gpu:
        rows += [submit_cost_row(torch, rng, bpc, m) for m in FLAGS.methods]
    if gpu and len(FLAGS.devices) > 1:
        rows += multi_device_rows(torch, [int(d) for d in FLAGS.devices], rng, bpc, blocks, moved)
    if FLAGS.out:
        machine = common.machine()
        if bulk:
            machine["bulk_gb_per_s"] = {d: (1 << 30) / s / 1e9 for d, s in bulk.items()}
        common.write_result(FLAGS.out, rows, machine, gpu_blocks=blocks, blocks_per_chunk=bpc, cpu_layout=CPU_LAYOUT,
                            calibration=(dataclasses.asdict(calibration.calibration())
                                         if gpu and "auto" in FLAGS.methods else None),
                            moved_mib=moved >> 20)

if __name__ == "__main__":
    app.run(main)
