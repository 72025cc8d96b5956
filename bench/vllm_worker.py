"""kvoffload's vLLM worker against vLLM 0.33's own CPUOffloadingWorker, on the caches vLLM
itself allocates, alone and beside a model (kvoffload.meter), with bulk copies as the
reference.

  bazel run //bench:vllm_worker -- --out=bench/results/vllm_worker_<gpu>.json

Per model (bench/vllm_caches.py), KV layout (vLLM's one allocation as LBHNC, BLHNC or
LBNHC, or per_layer as vLLM made it before 0.32) and kind of block ids (uniform random,
or vllm_pool: from vLLM's BlockPool and CPU manager under a trace of requests), every
source is kept in flight, two jobs per direction: bulk copies, vLLM's worker
(bench/vllm_peer.py), kvoffload's worker with each page path forced (pages_staged,
pages_dma, pages_dma_per_page: DMA without 2D copies), and ``region``: kvoffload's worker
with its default path on vLLM's SharedOffloadRegion as its pool (as KVOffloadTieringSpec
makes it). ``chosen`` is the path kvoffload's default ("pages") takes there; ``path``
what moved the bytes. Without a GPU it runs kvoffload's host path on a small cache and
says so.
"""

import itertools
import os
import re

import numpy as np
from absl import app, flags

import common
import vllm_caches
import vllm_peer
from kvoffload.meter import compute_loop, meter
from kvoffload.meter.sources import DIRECTIONS, BulkCopies, WorkerCopies
from kvoffload.pages import paths as page_methods
from kvoffload.pool import layout as pool_layout

FLAGS = flags.FLAGS
flags.DEFINE_list("layouts", ["tp8-8k", "4k", "llama8b-64k"], "Models to measure (vllm_caches.MODELS).")
flags.DEFINE_list("kv_layouts", ["LBHNC", "BLHNC"], "vLLM's KV layouts (vllm_caches.KV_LAYOUTS).")
flags.DEFINE_list("block_ids", ["uniform"], "uniform (random), vllm_pool (vLLM's BlockPool and CPU manager).")
flags.DEFINE_list("methods", ["vllm_worker", "pages_staged", "pages_dma"],
                  "Sources beside bulk: vllm_worker, region, a kvoffload method, pages_dma_per_page "
                  "(DMA, a copy per page), batch_per_job "
                  "(batch with one driver call per job), pages_staged_ctasN (the ring on N CTAs), "
                  "pages_staged_slotsMxN or pages_staged_l2_slotsMxN (a ring of N slots of M MiB, "
                  "in persisting L2 with l2_), or "
                  "pages_maxX (the page calibration's choice within a max_slowdown of X).")
flags.DEFINE_list("directions", list(DIRECTIONS), "store, load, both.")
flags.DEFINE_integer("steps", None, "Counted steps a window (default: kvoffload.meter's).")
flags.DEFINE_integer("rounds", meter.ROUNDS, "Busy windows per source.")
flags.DEFINE_float("alone_seconds", 1.0, "Seconds each source runs alone.")
flags.DEFINE_enum("workload", "decode", list(compute_loop.WORKLOADS), "The loop beside the copies "
                  "(kvoffload.meter.compute_loop).")
flags.DEFINE_enum("cpu_layout", None, list(pool_layout.CPU_LAYOUTS), "The host layout of kvoffload's "
                  "workers (default: the handler's; vLLM's worker keeps a CPU tensor per GPU tensor).")
flags.DEFINE_bool("beside", True, "Also measure each source beside the --workload loop (else alone only).")
flags.DEFINE_integer("dropped_handlers", 0, "kvoffload workers made, used and shut down in this "
                     "process before each layout's measured ones (a server that has restarted its "
                     "offloading).", lower_bound=0)
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")



def jobs(rng, groups, n, blocks, half=None, count=8):
    """count jobs of n random blocks per group to random chunks (as many chunks as GPU
    blocks; ids unique across groups, as vLLM's block pool gives them); half 0 or 1 keeps
    to that half of both."""
    lo, span = (0, blocks) if half is None else (half * blocks // 2, blocks // 2)
    return [(common.random_ids(rng, groups * n, span, lo), common.random_ids(rng, groups * n, span, lo))
            for _ in range(count)]


def pool_jobs(rng, groups, n, blocks, half=None, count=8):
    """As jobs, with ids from vLLM's BlockPool and CPU manager (vllm_caches.pool_jobs);
    each direction's from a seed of its own."""
    del rng
    lo, span = (0, blocks) if half is None else (half * blocks // 2, blocks // 2)
    args = vllm_caches.bench_pool_args(groups, n, blocks, half, count)
    return [(lo + gpu, lo + cpu) for gpu, cpu in vllm_caches.pool_jobs(*args)]



def specs(ids, groups, n):
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    return [(GPULoadStoreSpec(gpu.tolist(), [n] * groups, [0] * groups), CPULoadStoreSpec(cpu.tolist()))
            for gpu, cpu in ids]


def layout_jobs(rng, groups, n, blocks, kind):
    """Per measured direction, its jobs by direction: disjoint halves for both at once; and
    the mean run lengths of their ids."""
    make = jobs if kind == "uniform" else pool_jobs
    ids = {"store": make(rng, groups, n, blocks), "load": make(rng, groups, n, blocks)[::-1],
           "both store": make(rng, groups, n, blocks, half=0), "both load": make(rng, groups, n, blocks, half=1)}
    runs = [vllm_caches.run_lengths(gpu, cpu) for gpu, cpu in ids["store"]]
    mean_runs = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    s = {k: specs(v, groups, n) for k, v in ids.items()}
    return ({"store": {"store": s["store"]}, "load": {"load": s["load"]},
             "both": {"store": s["both store"], "load": s["both load"]}}, mean_runs)


def region_worker(cache, rows, blocks):
    """kvoffload's worker on a SharedOffloadRegion of ``blocks`` chunks, made as
    KVOffloadTieringSpec.create_worker makes it for one rank (without vLLM's config and
    tiers, which the GPU image cannot import)."""
    from vllm.utils.math_utils import round_up
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    from kvoffload.vllm import KVOffloadRegionWorker
    chunk = sum(rows)
    region = SharedOffloadRegion(engine_id=f"kvoffload-bench-{os.getpid()}", num_chunks=blocks, rank=0,
                                 kv_bytes_per_chunk=round_up(chunk, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT),
                                 cpu_page_size=chunk)
    try:
        return KVOffloadRegionWorker(cache, 1, blocks, region)
    except Exception:
        region.cleanup()
        raise


def batch_per_job():
    """kvoffload's host-planned batch method with one driver call per job, as vLLM's C++
    makes, in place of calls of kCopiesPerDriverCall copies."""
    import kvoffload as kv
    from kvoffload.copy import methods as copy_methods

    class BatchPerJob(copy_methods.Batch):
        def __call__(self, src, dst, sizes, stream=None, *, direction, order=kv.SrcAccessOrder.STREAM, registry):
            return kv.batch_copy(src, dst, sizes, stream, order=order, registry=registry,
                                 _max_copies_per_call=1 << 24)

    return BatchPerJob()


def page_method(method):
    """``pages_staged_ctasN`` (the ring's kernels on N CTAs), ``pages_dma_per_page`` (no 2D
    copies), ``pages_row_batches`` (2D copies in cuMemcpy3DBatchAsync calls), ``pages_rowsN`` (2D
    copies of at most N rows, band by band; ``pages_row_batches_rowsN``, in cuMemcpy3DBatchAsync
    calls; a ``_overlap`` suffix adds the driver's hint to overlap with compute),
    ``pages_overlap`` and ``pages_row_batches_overlap`` (that hint alone), ``pages_staged_slotsMxN`` (a ring
    of N slots of M MiB; ``pages_staged_l2_slotsMxN`` holds them in persisting L2),
    ``pages_maxX`` (the path chosen within a max_slowdown of X by the page calibration), or a
    method name as it is."""
    import kvoffload as kv
    ring = re.fullmatch(r"pages_staged_(l2_)?slots(\d+)x(\d+)", method)
    if ring is not None:
        return kv.Pages(kv.PagePath.STAGED, slot_bytes=int(ring[2]) << 20, slots=int(ring[3]),
                        slots_in_l2=ring[1] is not None)
    prefix = "pages_staged_ctas"
    if method.startswith(prefix):
        ctas = method[len(prefix):]
        if not ctas.isdigit():
            raise ValueError(f"--methods: expected {prefix}N with N a CTA count, got {method!r}")
        return kv.Pages(kv.PagePath.STAGED, ctas=int(ctas))
    if method == "pages_dma_per_page":
        return kv.Pages(kv.PagePath.DMA, strided=False)
    if method == "pages_row_batches":  # 2D copies many to a driver call
        return kv.Pages(row_batches=True)
    rows = re.fullmatch(r"pages(_row_batches)?_rows(\d+)(_overlap)?", method)
    if rows is not None:  # 2D copies of at most N rows, band by band
        return kv.Pages(rows_per_copy=int(rows[2]), row_batches=rows[1] is not None,
                        prefer_overlap=rows[3] is not None)
    if method in ("pages_overlap", "pages_row_batches_overlap"):  # the driver's hint to overlap with compute
        return kv.Pages(row_batches="row_batches" in method, prefer_overlap=True)
    if method.startswith("pages_max"):
        try:
            return kv.Pages(max_slowdown=float(method[len("pages_max"):]))
        except ValueError:
            raise ValueError(f"--methods: expected pages_maxX with X a max_slowdown, got {method!r}") from None
    return method


def path_of(method, handler, kv_layout, direction):
    """What moved the bytes: bulk, vllm (its worker), ring, strided_dma (2D copies),
    whole_blocks (a packed BLHNC block a copy), dma (a copy per page), or the method."""
    if method in ("bulk", "vllm_worker"):
        return "bulk" if method == "bulk" else "vllm"
    if handler is None:
        return method
    paths = []
    for d in ("store", "load") if direction == "both" else (direction,):
        name = handler.methods[d]
        if name == "pages_staged":
            paths.append("ring")
        elif name == "pages_dma":
            paths.append("strided_dma" if "2D copies" in handler.method_reasons[d]
                         else "whole_blocks" if kv_layout == "BLHNC" else "dma")
        else:
            paths.append(name)
    return "/".join(paths)


def main(argv):
    del argv
    import torch

    from kvoffload.vllm import KVOffloadWorker

    gpu = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name() if gpu else "cpu"
    process = f"{os.uname().nodename}:{os.getpid()}"
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    rng = np.random.default_rng(0)
    rows = []
    loop = clean_step = None
    if not gpu:
        print("no GPU: running kvoffload's host path on a small cache, not the PCIe link")
    else:
        if FLAGS.beside:
            loop = compute_loop.ComputeLoop(torch, FLAGS.workload)
            clean_step = meter.clean_step_seconds(loop)  # before any worker: idle_vs_clean
        peer = vllm_peer.install(torch)
    for layout, kv_layout, kind in itertools.product(FLAGS.layouts, FLAGS.kv_layouts, FLAGS.block_ids):
        n, blocks = vllm_caches.JOBS[layout]
        if not gpu:
            n, blocks = 8, 96
        cache, _, _ = vllm_caches.canonical_caches(torch, layout, kv_layout, blocks, "cuda" if gpu else "cpu")
        row_bytes = [t.page_size_bytes for t in cache.tensors]
        groups = len(cache.group_data_refs)
        specs, runs = layout_jobs(rng, groups, n, blocks, kind)
        for _ in range(FLAGS.dropped_handlers):
            dropped = KVOffloadWorker(cache, 1, blocks)
            for d in ("store", "load"):
                copies = WorkerCopies(dropped, specs[d], d)
                copies.top_up()
                copies.drain()
            dropped.shutdown()
        workers = {}
        for method in FLAGS.methods if gpu else ["host"]:
            if method == "vllm_worker":
                workers[method] = peer(cache, 1, blocks)
            elif method == "region":
                workers[method] = region_worker(cache, row_bytes, blocks)
            else:
                chosen_method = batch_per_job() if method == "batch_per_job" else page_method(method)
                workers[method] = KVOffloadWorker(cache, 1, blocks, cpu_layout=FLAGS.cpu_layout,
                                                  **({"method": chosen_method} if gpu else {}))
        default = KVOffloadWorker(cache, 1, blocks) if gpu else None
        chosen = default.handler.methods if gpu else {"store": "host", "load": "host"}
        chosen_why = default.handler.method_reasons if gpu else {}
        if default is not None:
            default.shutdown()
        page_bytes = [ref.page_size_bytes for group in cache.group_data_refs for ref in group]
        job_bytes = n * sum(page_bytes)
        sources = {}
        for direction in FLAGS.directions:
            if gpu:  # made once: its pinned buffers are not allocated inside a window
                bulk = BulkCopies(torch, direction, job_bytes)
                sources[("bulk", direction)] = lambda b=bulk: b
            for method, worker in workers.items():
                sources[(method, direction)] = lambda w=worker, d=direction: WorkerCopies(w, specs[d], d)
        name = f"{layout} {kv_layout} {kind}"
        built_by = "vllm" if kv_layout != "per_layer" and vllm_caches.vllms_code_runs() else "copy"
        base = dict(layout=layout, kv_layout=kv_layout, block_ids=kind, runs=runs, cache_built_by=built_by,
                    tensors=len(row_bytes),
                    page_bytes=max(page_bytes), groups=groups, blocks_per_job=n, job_mib=job_bytes / 2**20,
                    connections=connections, process=process, device=device_name,
                    dropped_handlers=FLAGS.dropped_handlers, workload=FLAGS.workload, chosen_why=chosen_why)
        alone = {key: meter.alone(make(), FLAGS.alone_seconds) for key, make in sources.items()}
        for (method, direction), rate in alone.items():
            print(f"{name:<26} {method:<18} {direction:<6} alone {rate:6.1f} GB/s")
        beside = meter.measure(loop, {f"{m} {d}": make for (m, d), make in sources.items()},
                               FLAGS.steps, FLAGS.rounds) if loop is not None else {}
        for (method, direction), rate in alone.items():
            handler = getattr(workers.get(method), "handler", None)
            paths = handler.methods if handler is not None else None
            row = dict(base, method=method, direction=direction, gb_per_s=rate,
                       path=path_of(method, handler, kv_layout, direction),
                       cpu_layout=getattr(handler, "cpu_layout", None),
                       paths=None if paths is None else paths["store"] if direction == "store"
                       else paths["load"] if direction == "load" else f"{paths['store']}/{paths['load']}",
                       chosen=chosen["store" if direction == "store" else "load"] if direction != "both"
                       else f"{chosen['store']}/{chosen['load']}")
            got = beside.get(f"{method} {direction}")
            if got is not None:
                bulk = beside[f"bulk {direction}"]
                row.update(gb_per_s_beside=got.gb_per_s, step_slowdown=got.step_slowdown,
                           bulk_step_slowdown=bulk.step_slowdown, idle_drift=got.idle_drift,
                           idle_vs_clean=got.idle_step_seconds / clean_step - 1,
                           noisy=got.noisy, windows=got.windows, dry_steps=got.dry_steps)
                print(f"{name:<26} {method:<18} {direction:<6} {got.summary()}; bulk {bulk.step_slowdown:+.2%}; "
                      f"idle {row['idle_vs_clean']:+.2%} over the clean loop; path {row['path']}")
            rows.append(row)
        for worker in workers.values():
            worker.shutdown()
        del cache, workers, sources
        if gpu:
            torch.cuda.empty_cache()
        write(rows, loop, clean_step)


def write(rows, loop, clean_step):
    """The rows so far, as JSON at --out (after every layout: a run cut short keeps them)."""
    if not FLAGS.out:
        return
    common.write_result(
        FLAGS.out, rows, common.machine(), workload=FLAGS.workload,
        step_seconds=loop.step_seconds if loop else None, clean_step_seconds=clean_step, steps=FLAGS.steps,
        rounds=FLAGS.rounds, noise=meter.NOISE, warm_seconds=meter.WARM_SECONDS,
        dma_from_page_bytes={d.value: b for d, b in page_methods.DMA_FROM_PAGE_BYTES.items()},
        note="caches from vLLM's own allocate_kv_cache and register_kv_caches (bench/vllm_caches.py); "
             "kvoffload.meter: each source kept in flight (two jobs per direction, fed from "
             "a thread of their own) through windows of at least 100 steps of the loop of "
             "kvoffload.meter.compute_loop named in workload, each between idle windows; "
             "step_slowdown against them, idle_drift their difference, idle_vs_clean their mean "
             "against the loop's before any worker was made. vllm_worker is vLLM "
             "0.33's CPUOffloadingWorker with bench/vllm_peer.py's stand-in op.")

if __name__ == "__main__":
    app.run(main)
