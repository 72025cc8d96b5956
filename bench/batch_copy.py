"""Batch copy benchmark: blocks scattered at random over large pools, every method
beside the bulk copy (the link's physical limit) measured in the same run.

  bazel run //bench:batch_copy -- --out=bench/results/batch_copy_<gpu>.json

Methods: one bulk copy of everything; the per-copy cudaMemcpyAsync loop (vLLM's
swap_blocks); cuMemcpyBatchAsync with STREAM (vLLM's stores) and with ANY (vLLM's
loads); kvoffload's raw-pointer kernel, staged and auto copies; and its id-addressed
page copies (kvoffload.pages.table, staged and direct), given the same blocks as block
and chunk ids. With --interference=model,decode,gemm each method is also kept in flight beside a
compute loop on kvoffload.meter, with bulk copies beside it as the reference of the same
run. Without a GPU it measures the host path instead, and says so.
"""

import functools
import signal
import sys
import time

import numpy as np
from absl import app, flags

import kvoffload as kv
from kvoffload import _C
from kvoffload.copy import methods as copy_methods
from kvoffload.copy.batch_copy import KERNEL_CTAS, STAGED_CTAS, STAGED_SLOTS, STAGED_SLOT_BYTES
from kvoffload.costs import auto
from kvoffload.meter import compute_loop, meter
from kvoffload.meter.sources import CALL_SECONDS, BulkCopies, RawCopies, in_calls
from kvoffload.pages import paths as page_methods
from kvoffload.pages.table import PageTable

import common

FLAGS = flags.FLAGS
flags.DEFINE_list("block_kib", ["4", "16", "64", "256", "1024", "2048"], "Block sizes in KiB.")
flags.DEFINE_float("pool_gib", 4.0, "Size of each of the host and device pools, GiB.")
flags.DEFINE_integer("moved_mib", 1024, "Bytes moved per measurement, MiB.")
flags.DEFINE_integer("repeats", 3, "Measurements per point; the best is kept.")
flags.DEFINE_list("directions", ["load", "store"], "load (host -> device) and/or store.")
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")
flags.DEFINE_string("plot", "", "Write a PNG plot of GB/s against block size here.")
flags.DEFINE_list("methods", ["per_copy", "batch", "batch_any", "kernel", "staged", "auto",
                             "pages_staged", "pages_kernel", "pages_dma"],
                  "Methods to measure beside the bulk copy, named as the library names them; batch_any "
                  "is batch with order=ANY (as vLLM's loads), auto_fastest is Auto(max_slowdown=None).")
flags.DEFINE_enum("pattern", "scattered", ["scattered", "host_runs"],
                  "scattered: both sides at random; host_runs: the host side in runs of "
                  "--run_kib (as a chunk-major pool gives), the device side at random.")
flags.DEFINE_integer("run_kib", 2048, "Host run size for --pattern=host_runs.")
flags.DEFINE_integer("kernel_ctas", KERNEL_CTAS, "CTA budget of the copy kernel.")
flags.DEFINE_integer("staged_ctas", STAGED_CTAS, "CTA budget of the staged copy's gather/scatter kernel.")
flags.DEFINE_integer("slot_mib", STAGED_SLOT_BYTES >> 20, "Staging slot size, MiB.")
flags.DEFINE_integer("slots", STAGED_SLOTS, "Staging slots.")
flags.DEFINE_list("interference", [], "Compute loops (model, decode, gemm; kvoffload.meter.compute_loop) beside "
                  "which to also run each method, at --interference_kib, reporting its step slowdown.")
flags.DEFINE_list("interference_kib", ["4", "16"], "Block sizes measured beside compute.")
flags.DEFINE_list("interference_methods", ["batch_any", "kernel", "staged", "auto", "pages_staged",
                                           "pages_kernel"], "Methods measured beside compute.")
flags.DEFINE_integer("page_ctas", _C.PAGE_COPY_CTAS, "CTAs of the page copies' kernels.")
flags.DEFINE_integer("page_slot_mib", _C.PAGE_SLOT_BYTES >> 20, "Staging slot size of the staged page copy, MiB.")
flags.DEFINE_integer("page_slots", _C.PAGE_SLOTS, "Staging slots of the staged page copy.")
flags.DEFINE_list("ctas", [], "CTA budgets N that add the methods kernel_ctasN and staged_ctasN "
                  "(for the frontier of GB/s against step slowdown).")
flags.DEFINE_bool("both", True, "Also measure stores and loads at once (direction 'both').")


# The benchmark's addresses are made inside its own pools.
UNCHECKED = dict(registry=kv.UNCHECKED)


def _with_stream(copy, stream, src, dst, sizes):
    return copy(src, dst, sizes, stream)


def gpu_methods(direction):
    """name -> copy(src, dst, sizes, stream)."""
    objects = {
        "per_copy": copy_methods.PerCopy(),
        "batch": copy_methods.Batch(),
        "kernel": copy_methods.Kernel(max_ctas=FLAGS.kernel_ctas),
        "staged": copy_methods.Staged(FLAGS.slot_mib << 20, FLAGS.slots, max_ctas=FLAGS.staged_ctas),
        "auto": kv.Auto(),
        "auto_fastest": kv.Auto(max_slowdown=None),
    }
    for n in map(int, FLAGS.ctas):
        objects[f"kernel_ctas{n}"] = copy_methods.Kernel(max_ctas=n)
        objects[f"staged_ctas{n}"] = copy_methods.Staged(FLAGS.slot_mib << 20, FLAGS.slots, max_ctas=n)
    methods = {name: functools.partial(method, direction=direction, **UNCHECKED) for name, method in objects.items()}
    methods["batch_any"] = functools.partial(copy_methods.Batch(), direction=direction, order=kv.SrcAccessOrder.ANY,
                                             **UNCHECKED)
    return methods


def host_offsets(rng, count, block, pool_bytes):
    if FLAGS.pattern == "scattered":
        return common.scattered_offsets(rng, count, block, pool_bytes)
    run = max(FLAGS.run_kib << 10, block)
    per_run = run // block
    runs = common.scattered_offsets(rng, -(-count // per_run), run, pool_bytes)
    i = np.arange(count, dtype=np.int64)
    return runs[i // per_run] + (i % per_run) * block


def time_gpu(torch, stream, submit):
    """(seconds on the stream, seconds inside the submitting call on the host)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record(stream)
    t = time.perf_counter()
    submit()
    host = time.perf_counter() - t
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3, host


class PageJobs:
    """The benchmark's pools as a PageTable: one tensor of blocks over the device pool, and
    chunks of one host run (one block when scattered) over the host pool."""

    def __init__(self, pools, block, pool):
        self.block = block
        self.bpc = max(1, (FLAGS.run_kib << 10) // block) if FLAGS.pattern == "host_runs" else 1
        run = self.bpc * block
        refs = np.array([[pools["device"].data_ptr(), block, block, pools["host"].data_ptr(), run]],
                        dtype=np.int64)
        self.table = PageTable(refs, *(np.array([n], np.int64) for n in (1, pool // block, pool // run)), self.bpc,
                               np.zeros(0, np.int64))
        self.pool = pool

    def job(self, rng, count):
        """count random distinct blocks, to random distinct chunks."""
        blocks = common.scattered_offsets(rng, count, self.block, self.pool) // self.block
        chunks = common.scattered_offsets(rng, -(-count // self.bpc), self.bpc * self.block, self.pool)
        return blocks, chunks // (self.bpc * self.block), [count], [0]

    def copy(self, job, direction, stream, method):
        """The job by a forced page method (page_methods.FORCED: pages_staged, ...)."""
        return self.table.copy(*job, direction=kv.Direction.parse(direction, "direction").native, stream=stream, path=page_methods.FORCED[method],
                               max_ctas=FLAGS.page_ctas, slot_bytes=FLAGS.page_slot_mib << 20,
                               slots=FLAGS.page_slots)


def measure_gpu(rng, rows, machine):
    """Appends every measured row to ``rows`` as it is measured."""
    import torch

    pool = int(FLAGS.pool_gib * (1 << 30))
    moved = FLAGS.moved_mib << 20
    pools = {
        "host": torch.empty(pool, dtype=torch.uint8, pin_memory=True),
        "device": torch.empty(pool, dtype=torch.uint8, device="cuda"),
    }
    streams = {"load": torch.cuda.Stream(), "store": torch.cuda.Stream()}
    ends = {"load": ("host", "device"), "store": ("device", "host")}
    loops = {w: compute_loop.ComputeLoop(torch, w) for w in FLAGS.interference}
    for workload, loop in loops.items():
        machine[f"{workload}_step_seconds"] = loop.step_seconds

    def bulk(direction, stream):
        src, dst = (pools[e].data_ptr() for e in ends[direction])
        return lambda: kv.batch_copy([src], [dst], [moved], stream, per_copy=True, **UNCHECKED)

    beside = {}  # source name -> (row, make the source)

    def measure(row, copies, kib, stream, batch=None):
        """Fills in row's rate alone and, at the interference sizes, names its source for
        the meter: ``batch`` (copy, src, dst, sizes) in calls of CALL_SECONDS alone, else
        the copies whole."""
        best, host = min(time_gpu(torch, stream, lambda: [c() for c in copies])
                         for _ in range(FLAGS.repeats))
        rows.append(dict(row, seconds=best, submit_seconds=host))
        if kib in FLAGS.interference_kib and row["method"] in FLAGS.interference_methods:
            block = int(kib) << 10
            call_bytes = max(block, int(moved / best * CALL_SECONDS) // block * block)
            calls = (in_calls(*batch, call_bytes) if batch is not None
                     else [(lambda: [c() for c in copies], moved * len(copies))])
            beside[f"{row['method']} {row['direction']} {kib}"] = (
                dict(row, seconds=best), functools.partial(RawCopies, torch, calls, stream))

    for direction in FLAGS.directions:
        stream = streams[direction]
        best, host = min(time_gpu(torch, stream, bulk(direction, stream)) for _ in range(FLAGS.repeats))
        rows.append(dict(method="bulk", direction=direction, block_bytes=moved, seconds=best,
                         submit_seconds=host))
    if FLAGS.both:
        both = [bulk(d, streams[d]) for d in ("load", "store")]
        seconds = min(both_at_once(torch, streams, both) for _ in range(FLAGS.repeats))
        rows.append(dict(method="bulk", direction="both", block_bytes=moved, seconds=seconds))
    for kib in FLAGS.block_kib:
        block = int(kib) << 10
        count = moved // block
        pages = PageJobs(pools, block, pool)
        jobs = {}
        for direction in FLAGS.directions:
            stream = streams[direction]
            methods = gpu_methods(direction)
            h = host_offsets(rng, count, block, pool) + pools["host"].data_ptr()
            g = common.scattered_offsets(rng, count, block, pool) + pools["device"].data_ptr()
            s, d = (h, g) if direction == "load" else (g, h)
            sizes = np.full(count, block, dtype=np.int64)
            jobs[direction] = pages.job(rng, count)
            for method in FLAGS.methods:
                if method.startswith("pages_"):
                    copy = functools.partial(pages.copy, jobs[direction], direction, stream, method)
                row = dict(method=method, direction=direction, block_bytes=block)
                if method.startswith("auto"):  # the candidate it takes for this job
                    row["chosen"] = auto.chosen(s, d, sizes, stream, direction=direction, **UNCHECKED,
                                                max_slowdown=None if method == "auto_fastest" else auto.MAX_SLOWDOWN)
                if not method.startswith("pages_"):
                    run = functools.partial(_with_stream, methods[method], stream)
                    copy = functools.partial(run, s, d, sizes)
                measure(row, [copy], kib, stream, None if method.startswith("pages_") else (run, s, d, sizes))
        if FLAGS.both and len(jobs) == 2:
            # Stores and loads at once, on disjoint blocks (two halves of a fresh job).
            job = pages.job(rng, count)
            half = count // 2 // pages.bpc * pages.bpc
            store = (job[0][:half], job[1][: half // pages.bpc], [half], [0])
            load = (job[0][half:2 * half], job[1][half // pages.bpc: 2 * half // pages.bpc], [half], [0])
            for method in [m for m in FLAGS.methods if m.startswith("pages_")]:
                copies = [functools.partial(pages.copy, store, "store", streams["store"], method),
                          functools.partial(pages.copy, load, "load", streams["load"], method)]
                seconds = min(both_at_once(torch, streams, copies) for _ in range(FLAGS.repeats))
                rows.append(dict(method=method, direction="both", block_bytes=block,
                                 seconds=seconds * moved / (half * block)))
    for workload, loop in loops.items():
        sources = {name: make for name, (_, make) in beside.items()}
        for direction in FLAGS.directions:  # made once: its pinned buffers are not allocated in a window
            bulk = BulkCopies(torch, direction, moved)
            sources[f"bulk {direction}"] = lambda b=bulk: b
        got = meter.measure(loop, sources)
        for name, (row, _) in beside.items():
            r, bulk = got[name], got[f"bulk {row['direction']}"]
            print(f"{name} beside {workload}: {r.summary()}; bulk {bulk.step_slowdown:+.2%}")
            rows.append(dict(row, workload=workload, gb_per_s_beside=r.gb_per_s, step_slowdown=r.step_slowdown,
                             bulk_step_slowdown=bulk.step_slowdown, idle_drift=r.idle_drift, noisy=r.noisy,
                             dry_steps=r.dry_steps))


def both_at_once(torch, streams, copies):
    """Seconds from the first to the last byte of copies enqueued on the two streams at once."""
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
    torch.cuda.synchronize()
    start.record(streams["load"])
    streams["store"].wait_event(start)
    for copy in copies:
        copy()
    for end, stream in zip(ends, streams.values()):
        end.record(stream)
    torch.cuda.synchronize()
    return max(start.elapsed_time(end) for end in ends) / 1e3


def measure_host(rng, rows, machine):
    pool = min(int(FLAGS.pool_gib * (1 << 30)), 512 << 20)
    moved = min(FLAGS.moved_mib << 20, pool // 2)
    src = np.ones(pool, dtype=np.uint8)
    dst = np.zeros(pool, dtype=np.uint8)

    def timed(*args):
        best = float("inf")
        for _ in range(FLAGS.repeats):
            t = time.perf_counter()
            kv.host_copy(*args, **UNCHECKED)
            best = min(best, time.perf_counter() - t)
        return best

    base_s, base_d = src.ctypes.data, dst.ctypes.data
    rows.append(dict(method="bulk", direction="h2h", block_bytes=moved,
                     seconds=timed([base_s], [base_d], [moved])))
    for kib in FLAGS.block_kib:
        block = int(kib) << 10
        count = moved // block
        s = common.scattered_offsets(rng, count, block, pool) + base_s
        d = common.scattered_offsets(rng, count, block, pool) + base_d
        rows.append(dict(method="host_copy", direction="h2h", block_bytes=block,
                         seconds=timed(s, d, np.full(count, block, dtype=np.int64))))


def host_machine():
    pool = min(int(FLAGS.pool_gib * (1 << 30)), 512 << 20)
    return common.machine(moved_bytes=min(FLAGS.moved_mib << 20, pool // 2), pool_bytes=pool)


def has_gpu():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def add_rates(rows):
    bulk = {r["direction"]: r for r in rows if r["method"] == "bulk"}
    for r in rows:
        moved = bulk[r["direction"]]["block_bytes"] * (2 if r["direction"] == "both" else 1)
        r["gb_per_s"] = moved / r["seconds"] / 1e9
        r["ratio_to_bulk"] = bulk[r["direction"]]["seconds"] / r["seconds"]
        if "submit_seconds" in r:
            r["submit_us_per_copy"] = r["submit_seconds"] / (moved // r["block_bytes"]) * 1e6
        if "gb_per_s_beside" in r:
            r["ratio_beside_to_bulk"] = r["gb_per_s_beside"] / bulk[r["direction"]]["gb_per_s"]
    vllm = ("per_copy", "batch", "batch_any")
    for r in rows:
        peers = [p["gb_per_s"] for p in rows if p["method"] in vllm and
                 (p["direction"], p["block_bytes"]) == (r["direction"], r["block_bytes"])]
        if peers and r["method"] not in vllm:
            r["ratio_to_best_vllm_method"] = r["gb_per_s"] / max(peers)


def print_table(all_rows):
    rows = [r for r in all_rows if "workload" not in r]
    sizes = sorted({r["block_bytes"] for r in rows if r["method"] != "bulk"})
    header = f"{'method':<14}{'dir':<5}" + "".join(f"{s >> 10:>8} KiB" for s in sizes)
    print(header)
    for direction in dict.fromkeys(r["direction"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows):
            cells = {r["block_bytes"]: r for r in rows
                     if r["method"] == method and r["direction"] == direction}
            if not cells:
                continue
            if method == "bulk":
                (r,) = cells.values()
                print(f"{method:<14}{direction:<5}{r['gb_per_s']:>8.1f} GB/s (one copy of "
                      f"{r['block_bytes'] >> 20} MiB: the baseline)")
                continue
            print(f"{method:<14}{direction:<5}" + "".join(
                f"{cells[s]['gb_per_s']:>6.1f} {cells[s]['ratio_to_bulk']:>4.0%}" if s in cells
                else " " * 12 for s in sizes))
    print("each cell: GB/s and the ratio to the bulk copy of the same direction")
    ours = [r for r in rows if "ratio_to_best_vllm_method" in r]
    if ours:
        print("against the best of vLLM's methods (per-copy, batch STREAM, batch ANY): " + ", ".join(
            f"{r['method']} {r['direction']} {r['block_bytes'] >> 10}K {r['ratio_to_best_vllm_method']:.1f}x"
            for r in ours))
    beside = [r for r in all_rows if "workload" in r]
    if beside:
        print("beside a compute loop (kvoffload.meter): GB/s alone, GB/s beside (ratio to bulk), "
              "the loop's step slowdown against its idle windows, and the bulk copies'")
        for r in beside:
            print(f"  {r['workload']:<6}{r['method']:<14}{r['direction']:<5}{r['block_bytes'] >> 10:>6} KiB "
                  f"{r['gb_per_s']:6.1f} {r['gb_per_s_beside']:6.1f} GB/s ({r['ratio_beside_to_bulk']:4.0%})"
                  f"  slowdown {r['step_slowdown']:+.2%} (bulk {r['bulk_step_slowdown']:+.2%}, idle drift "
                  f"{r['idle_drift']:+.2%}{', NOISY' if r['noisy'] else ''}"
                  f"{', the loop ran dry %d times' % r['dry_steps'] if r['dry_steps'] else ''})")
    if beside:
        print_frontier(beside)
    submit = [r for r in rows if "submit_us_per_copy" in r and r["method"] != "bulk"]
    if submit:
        print("host time inside the call, us per copy: " + ", ".join(
            f"{r['method']} {r['direction']} {r['block_bytes'] >> 10}K {r['submit_us_per_copy']:.2f}"
            for r in submit))


def print_frontier(beside):
    """Per compute loop, direction and block size: every method by step slowdown, '*' on
    the frontier (nothing else both faster beside the loop and gentler to it), and what
    auto chose."""
    print("frontier beside compute: GB/s beside against step slowdown ('*': not beaten on both)")
    for key in dict.fromkeys((r["workload"], r["direction"], r["block_bytes"]) for r in beside):
        points = sorted((r for r in beside if (r["workload"], r["direction"], r["block_bytes"]) == key),
                        key=lambda r: r["step_slowdown"])
        cells = []
        for r in points:
            beaten = any(o["gb_per_s_beside"] > r["gb_per_s_beside"] and o["step_slowdown"] < r["step_slowdown"]
                         for o in points)
            chosen = f" ({r['chosen']})" if "chosen" in r else ""
            cells.append(f"{'' if beaten else '*'}{r['method']}{chosen} {r['gb_per_s_beside']:.1f} GB/s "
                         f"{r['step_slowdown']:+.1%}")
        print(f"  {key[0]:<6}{key[1]:<5}{key[2] >> 10:>6} KiB: " + ", ".join(cells))


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    gpu = has_gpu()
    if not gpu:
        print("no GPU: measuring the host path (memcpy), not the PCIe link")
    machine = common.machine() if gpu else host_machine()
    rows = []
    # A run cut short (SIGTERM, Ctrl-C) still reports and writes what it measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        (measure_gpu if gpu else measure_host)(rng, rows, machine)
        complete = True
    except (KeyboardInterrupt, SystemExit):
        complete = False
        print(f"interrupted: reporting the {len(rows)} rows measured so far")
    add_rates(rows)
    print_table(rows)
    if FLAGS.out:
        common.write_result(FLAGS.out, rows, machine, complete=complete, pool_gib=FLAGS.pool_gib,
                            moved_mib=FLAGS.moved_mib, repeats=FLAGS.repeats, pattern=FLAGS.pattern,
                            run_kib=FLAGS.run_kib, kernel_ctas=FLAGS.kernel_ctas, staged_ctas=FLAGS.staged_ctas,
                            slot_mib=FLAGS.slot_mib, slots=FLAGS.slots, page_ctas=FLAGS.page_ctas,
                            page_slot_mib=FLAGS.page_slot_mib, page_slots=FLAGS.page_slots,
                            interference=FLAGS.interference, ctas=FLAGS.ctas)
    if not complete:
        sys.exit(143)
    if FLAGS.plot:
        plot(rows, machine, FLAGS.plot)


def plot(rows, machine, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = list(dict.fromkeys(r["direction"] for r in rows))
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), 4.5), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "bulk"):
            cells = sorted((r["block_bytes"] >> 10, r["gb_per_s"]) for r in rows
                           if r["method"] == method and r["direction"] == direction)
            ax.plot(*zip(*cells), marker="o", label=method)
        bulk = next(r["gb_per_s"] for r in rows if r["method"] == "bulk" and r["direction"] == direction)
        ax.axhline(bulk, color="black", linestyle="--", label=f"bulk copy {bulk:.1f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (KiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{direction.upper()}, {FLAGS.pattern}, {machine['device']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
