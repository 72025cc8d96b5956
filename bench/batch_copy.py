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

FLAGS = flags.FLAGS
flags.DEFINE_list("block_kib", ["4", "16", "64", "256", "1024", "2048"], "Block sizes in KiB.")
flags.DEFINE_float("pool_gib", 4.0, "Size of each of the host and device pools, GiB.")
flags.DEFINE_integer("moved_mib", 1024, "Bytes moved per measurement, MiB.")
flags.DEFINE_integer("repeats", 3, "Measurements per point; the best is kept.")
flags.DEFINE_list("directions", ["h2d", "d2h"], "h2d and/or d2h.")
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")

GPU_METHODS = {
    # name -> batch_copy keyword arguments
    "per_copy": dict(per_copy=True),
    "batch_stream": dict(order=kv.SrcAccessOrder.STREAM),
    "batch_any": dict(order=kv.SrcAccessOrder.ANY),
}


def scattered_offsets(rng, count, block, pool_bytes):
    """Distinct random block slots in a pool, as byte offsets."""
    return rng.permutation(pool_bytes // block)[:count].astype(np.int64) * block


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
    for direction in FLAGS.directions:
        src, dst = (pools[e].data_ptr() for e in ends[direction])
        bulk, host = min(
            time_gpu(torch, stream, lambda: kv.batch_copy([src], [dst], [moved], stream, per_copy=True))
            for _ in range(FLAGS.repeats))
        rows.append(dict(method="bulk", direction=direction, block_bytes=moved, seconds=bulk,
                         submit_seconds=host))
        for kib in FLAGS.block_kib:
            block = int(kib) << 10
            count = moved // block
            s = scattered_offsets(rng, count, block, pool) + src
            d = scattered_offsets(rng, count, block, pool) + dst
            sizes = np.full(count, block, dtype=np.int64)
            for method, kwargs in GPU_METHODS.items():
                best, host = min(
                    time_gpu(torch, stream, lambda: kv.batch_copy(s, d, sizes, stream, **kwargs))
                    for _ in range(FLAGS.repeats))
                rows.append(dict(method=method, direction=direction, block_bytes=block, seconds=best,
                                 submit_seconds=host))
    return rows, dict(device=torch.cuda.get_device_name(), driver=driver_version(),
                      torch=torch.__version__, cuda_runtime=torch.version.cuda,
                      batch_entry_point=kv.batch_entry_point_version())


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
            kv.host_copy(*args)
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
                      pattern="both sides scattered at random")
        with open(out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(), machine=machine, config=config,
                           results=rows), f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
