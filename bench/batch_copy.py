"""Batch copy benchmark: blocks scattered at random over large pools, every method
beside the bulk copy (the link's physical limit) measured in the same run.

  bazel run //bench:batch_copy -- --out=bench/results/batch_copy_<gpu>.json

Methods: one bulk copy of everything; the per-copy cudaMemcpyAsync loop (vLLM's
swap_blocks); cuMemcpyBatchAsync with STREAM (vLLM's stores) and with ANY (vLLM's
loads). Without a GPU it measures the host path instead, and says so.
"""

import datetime
import json
import os
import subprocess
import time

import numpy as np
from absl import app, flags

import kvoffload as kv
from kvoffload import auto

FLAGS = flags.FLAGS
flags.DEFINE_list("block_kib", ["4", "16", "64", "256", "1024", "2048"], "Block sizes in KiB.")
flags.DEFINE_float("pool_gib", 4.0, "Size of each of the host and device pools, GiB.")
flags.DEFINE_integer("moved_mib", 1024, "Bytes moved per measurement, MiB.")
flags.DEFINE_integer("repeats", 3, "Measurements per point; the best is kept.")
flags.DEFINE_list("directions", ["h2d", "d2h"], "h2d and/or d2h.")
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")
flags.DEFINE_string("plot", "", "Write a PNG plot of GB/s against block size here.")
flags.DEFINE_list("methods", ["per_copy", "batch_stream", "batch_any", "kernel", "staged", "auto"],
                  "Methods to measure beside the bulk copy.")
flags.DEFINE_enum("pattern", "scattered", ["scattered", "host_runs"],
                  "scattered: both sides at random; host_runs: the host side in runs of "
                  "--run_kib (as a chunk-major pool gives), the device side at random.")
flags.DEFINE_integer("run_kib", 2048, "Host run size for --pattern=host_runs.")
flags.DEFINE_integer("kernel_ctas", 8, "CTA budget of the copy kernel.")
flags.DEFINE_integer("staged_ctas", 8, "CTA budget of the staged copy's gather/scatter kernel.")
flags.DEFINE_integer("slot_mib", 16, "Staging slot size, MiB.")
flags.DEFINE_integer("slots", 4, "Staging slots.")
flags.DEFINE_list("interference_kib", [], "Block sizes at which to also run each method beside "
                  "a bf16 8192^3 matrix-product loop and report its slowdown.")


# The benchmark's addresses are made inside its own pools.
UNCHECKED = dict(registry=kv.UNCHECKED)


def gpu_methods(direction):
    """name -> copy(src, dst, sizes, stream)."""
    load = direction == "h2d"
    return {
        "per_copy": lambda s, d, z, st: kv.batch_copy(s, d, z, st, per_copy=True, **UNCHECKED),
        "batch_stream": lambda s, d, z, st: kv.batch_copy(s, d, z, st, order=kv.SrcAccessOrder.STREAM, **UNCHECKED),
        "batch_any": lambda s, d, z, st: kv.batch_copy(s, d, z, st, order=kv.SrcAccessOrder.ANY, **UNCHECKED),
        "kernel": lambda s, d, z, st: kv.kernel_copy(s, d, z, st, max_ctas=FLAGS.kernel_ctas, **UNCHECKED),
        "staged": lambda s, d, z, st: kv.staged_copy(
            s, d, z, load, st, slot_bytes=FLAGS.slot_mib << 20, slots=FLAGS.slots,
            max_ctas=FLAGS.staged_ctas, **UNCHECKED),
        "auto": lambda s, d, z, st: auto.copy(s, d, z, st, direction=direction, **UNCHECKED),
    }


def scattered_offsets(rng, count, block, pool_bytes):
    """Distinct random block slots in a pool, as byte offsets."""
    return rng.permutation(pool_bytes // block)[:count].astype(np.int64) * block


def host_offsets(rng, count, block, pool_bytes):
    if FLAGS.pattern == "scattered":
        return scattered_offsets(rng, count, block, pool_bytes)
    run = max(FLAGS.run_kib << 10, block)
    per_run = run // block
    runs = scattered_offsets(rng, -(-count // per_run), run, pool_bytes)
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


def matmul_loop(torch, iterations=200):
    """A bf16 8192^3 matrix-product loop on its own stream: (start and end events, run)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def run():
        events[0].record(stream)
        with torch.cuda.stream(stream):
            for _ in range(iterations):
                torch.mm(a, b)
        events[1].record(stream)
        torch.cuda.synchronize()
        return events[0].elapsed_time(events[1]) / 1e3

    def run_beside(stream_of_copies, copy):
        """Copies back to back while the loop runs: (seconds per copy, loop seconds)."""
        torch.cuda.synchronize()
        events[0].record(stream)
        with torch.cuda.stream(stream):
            for _ in range(iterations):
                torch.mm(a, b)
        events[1].record(stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream_of_copies)
        copies = 0
        while copies == 0 or not events[1].query():
            copy()
            copies += 1
            stream_of_copies.synchronize()
        end.record(stream_of_copies)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / copies, events[0].elapsed_time(events[1]) / 1e3

    run()
    return run, run_beside


def measure_gpu(rng):
    import torch

    pool = int(FLAGS.pool_gib * (1 << 30))
    moved = FLAGS.moved_mib << 20
    pools = {
        "host": torch.empty(pool, dtype=torch.uint8, pin_memory=True),
        "device": torch.empty(pool, dtype=torch.uint8, device="cuda"),
    }
    stream = torch.cuda.Stream()
    ends = {"h2d": ("host", "device"), "d2h": ("device", "host")}
    rows = []
    mm = matmul_loop(torch) if FLAGS.interference_kib else None
    alone = min(mm[0]() for _ in range(2)) if mm else None
    for direction in FLAGS.directions:
        src, dst = (pools[e].data_ptr() for e in ends[direction])
        bulk, host = min(
            time_gpu(torch, stream, lambda: kv.batch_copy([src], [dst], [moved], stream, per_copy=True, **UNCHECKED))
            for _ in range(FLAGS.repeats))
        rows.append(dict(method="bulk", direction=direction, block_bytes=moved, seconds=bulk,
                         submit_seconds=host))
        methods = gpu_methods(direction)
        for kib in FLAGS.block_kib:
            block = int(kib) << 10
            count = moved // block
            h = host_offsets(rng, count, block, pool) + pools["host"].data_ptr()
            g = scattered_offsets(rng, count, block, pool) + pools["device"].data_ptr()
            s, d = (h, g) if direction == "h2d" else (g, h)
            sizes = np.full(count, block, dtype=np.int64)
            for method in FLAGS.methods:
                copy = lambda: methods[method](s, d, sizes, stream)
                best, host = min(time_gpu(torch, stream, copy) for _ in range(FLAGS.repeats))
                row = dict(method=method, direction=direction, block_bytes=block, seconds=best,
                           submit_seconds=host)
                if mm and kib in FLAGS.interference_kib:
                    per_copy, with_copies = mm[1](stream, copy)
                    row["seconds_beside_matmul"] = per_copy
                    row["matmul_slowdown"] = with_copies / alone - 1
                rows.append(row)
    machine = dict(device=torch.cuda.get_device_name(), driver=driver_version(),
                   torch=torch.__version__, cuda_runtime=torch.version.cuda,
                   batch_entry_point=kv.batch_entry_point_version())
    if mm:
        machine["matmul_alone_seconds"] = alone
    return rows, machine


def measure_host(rng):
    pool = min(int(FLAGS.pool_gib * (1 << 30)), 512 << 20)
    moved = min(FLAGS.moved_mib << 20, pool // 2)
    src = np.ones(pool, dtype=np.uint8)
    dst = np.zeros(pool, dtype=np.uint8)
    rows = []

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
        s = scattered_offsets(rng, count, block, pool) + base_s
        d = scattered_offsets(rng, count, block, pool) + base_d
        rows.append(dict(method="host_copy", direction="h2h", block_bytes=block,
                         seconds=timed(s, d, np.full(count, block, dtype=np.int64))))
    return rows, dict(device="none (host path)", moved_bytes=moved, pool_bytes=pool)


def driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True)
        return out.stdout.split("\n")[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def has_gpu():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def add_rates(rows):
    bulk = {r["direction"]: r for r in rows if r["method"] == "bulk"}
    for r in rows:
        moved = bulk[r["direction"]]["block_bytes"]
        r["gb_per_s"] = moved / r["seconds"] / 1e9
        r["ratio_to_bulk"] = bulk[r["direction"]]["seconds"] / r["seconds"]
        if "submit_seconds" in r:
            r["submit_us_per_copy"] = r["submit_seconds"] / (moved // r["block_bytes"]) * 1e6
        if "seconds_beside_matmul" in r:
            r["gb_per_s_beside_matmul"] = moved / r["seconds_beside_matmul"] / 1e9
    vllm = ("per_copy", "batch_stream", "batch_any")
    for r in rows:
        peers = [p["gb_per_s"] for p in rows if p["method"] in vllm and
                 (p["direction"], p["block_bytes"]) == (r["direction"], r["block_bytes"])]
        if peers and r["method"] not in vllm:
            r["ratio_to_best_vllm_method"] = r["gb_per_s"] / max(peers)


def print_table(rows):
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
    beside = [r for r in rows if "matmul_slowdown" in r]
    if beside:
        print("beside a bf16 8192^3 matrix-product loop: GB/s and the loop's slowdown")
        for r in beside:
            print(f"  {r['method']:<14}{r['direction']:<5}{r['block_bytes'] >> 10:>6} KiB "
                  f"{r['gb_per_s_beside_matmul']:6.1f} GB/s  slowdown {r['matmul_slowdown']:+.1%}")
    submit = [r for r in rows if "submit_us_per_copy" in r and r["method"] != "bulk"]
    if submit:
        print("host time inside the call, us per copy: " + ", ".join(
            f"{r['method']} {r['direction']} {r['block_bytes'] >> 10}K {r['submit_us_per_copy']:.2f}"
            for r in submit))


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    gpu = has_gpu()
    if not gpu:
        print("no GPU: measuring the host path (memcpy), not the PCIe link")
    rows, machine = measure_gpu(rng) if gpu else measure_host(rng)
    add_rates(rows)
    print_table(rows)
    if FLAGS.out:
        out = FLAGS.out
        if not os.path.isabs(out) and "BUILD_WORKSPACE_DIRECTORY" in os.environ:
            out = os.path.join(os.environ["BUILD_WORKSPACE_DIRECTORY"], out)
        config = dict(pool_gib=FLAGS.pool_gib, moved_mib=FLAGS.moved_mib, repeats=FLAGS.repeats,
                      pattern=FLAGS.pattern, run_kib=FLAGS.run_kib, kernel_ctas=FLAGS.kernel_ctas,
                      staged_ctas=FLAGS.staged_ctas, slot_mib=FLAGS.slot_mib, slots=FLAGS.slots)
        with open(out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), machine=machine, config=config,
                           results=rows), f, indent=1)
        print(f"wrote {out}")
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
