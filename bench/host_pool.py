"""Host pool benchmark: how fast each way makes N GiB of pinned host memory ready, the
resident memory it costs, and the bulk copy rate from its first and last GiB.

  bazel run //bench:host_pool -- --gib=20,40

Ways: torch's pin_memory allocator (what kvoffload used before its own pool), vLLM's
(mmap, MADV_POPULATE_WRITE, one cudaHostRegister), and kvoffload.pool.host_pool.HostPool.
Each way and size runs in a fresh process, one after another, so each starts from the
same free memory and gives all of it back before the next. Without a GPU only the
mapping and touching are measured (torch: torch.zeros), and nothing is written unless
--out is given.
"""

import mmap
import multiprocessing
import os
import sys
import time

from absl import app, flags

try:
    import kvoffload  # noqa: F401
except ImportError:  # run as bench/host_pool.py from a GPU bundle (tools/stage_gpu_bundle.sh)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvoffload.pool.host_pool import PoolOptions  # noqa: E402 - after the path above

import common

FLAGS = flags.FLAGS
flags.DEFINE_list("gib", ["20", "40"], "Pool sizes, GiB.")
flags.DEFINE_list("ways", ["torch", "vllm", "kvoffload"], "Ways to measure.")
flags.DEFINE_list("register_threads", [str(PoolOptions.register_threads)],
                  "kvoffload's PoolOptions.register_threads to measure (default: its default).")
flags.DEFINE_list("huge_pages", [PoolOptions.huge_pages], "kvoffload's PoolOptions.huge_pages to measure "
                  "(default: its default).")
flags.DEFINE_float("registration_gib", None, "kvoffload's PoolOptions.registration_bytes, GiB (default: its own).")
flags.DEFINE_float("copy_gib", 1.0, "GiB copied host-to-device from each end of the pool.")
flags.DEFINE_string("out", None, "Write the results as JSON here (relative to the workspace); "
                    "default with a GPU: bench/results/host_pool_<gpu>.json.")

_MADV_POPULATE_WRITE = 23


def used_bytes():
    """MemTotal - MemAvailable: what the machine's memory holds that it cannot give back."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def allocate(way, nbytes, gpu, options):
    """The memory, made ready the given way: (a uint8 torch tensor over it, what to keep)."""
    import numpy as np
    import torch

    if way == "torch":
        tensor = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if gpu
                  else torch.zeros(nbytes, dtype=torch.uint8))
        return tensor, tensor
    if way == "vllm":
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        memory.madvise(_MADV_POPULATE_WRITE)
        array = np.frombuffer(memory, np.uint8)
        if gpu:
            status = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, nbytes, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister: error {int(status)}")
        return torch.from_numpy(array), memory
    from kvoffload.pool.host_pool import HostPool, PoolOptions

    pool = HostPool(nbytes, pinned=gpu, options=PoolOptions(**options))
    return pool.tensor, pool


def copy_rate(torch, host, device):
    """GB/s of the best of 3 host-to-device copies, CUDA events."""
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, host.numel() / (start.elapsed_time(end) / 1e3) / 1e9)
    return best


def measure(way, nbytes, gpu, copy_bytes, options, conn):
    """One way, one size, in this (fresh) process; the row goes to ``conn``."""
    import torch

    if gpu:
        torch.zeros(1, device="cuda")  # the CUDA context, outside the timing
    before = used_bytes()
    start = time.perf_counter()
    tensor, keep = allocate(way, nbytes, gpu, options)
    seconds = time.perf_counter() - start
    growth = used_bytes() - before
    row = dict(way=way, requested_bytes=nbytes, seconds=seconds, ready_gb_per_s=nbytes / seconds / 1e9,
               resident_growth_bytes=growth, copy_gb_per_s=None)
    if way == "kvoffload":
        # Touching and registering overlap (registration k is made while k+1 is touched).
        row.update(options, touch_seconds=keep.touch_seconds, register_seconds=keep.register_seconds)
    if gpu:
        device = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
        first = copy_rate(torch, tensor[:copy_bytes], device)
        last = copy_rate(torch, tensor[nbytes - copy_bytes:], device)
        row.update(copy_gb_per_s=min(first, last), copy_first_gb_per_s=first, copy_last_gb_per_s=last)
    conn.send(row)
    del tensor, keep


def run(way, nbytes, gpu, copy_bytes, options=None):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=measure, args=(way, nbytes, gpu, copy_bytes, options or {}, child))
    process.start()
    try:
        row = parent.recv()
    except EOFError:
        row = None
    process.join()
    if row is None or process.exitcode != 0:
        raise RuntimeError(f"{way} at {nbytes} bytes: the measuring process exited with {process.exitcode}")
    return row


def kvoffload_options():
    """Every PoolOptions the flags ask for, as keyword dicts."""
    from kvoffload.pool.host_pool import PoolOptions

    registration = int(FLAGS.registration_gib * 2**30) if FLAGS.registration_gib else PoolOptions.registration_bytes
    return [dict(register_threads=int(threads), huge_pages=huge, registration_bytes=registration)
            for threads in FLAGS.register_threads for huge in FLAGS.huge_pages]


def gpu_name():
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def print_row(row):
    copy = "-" if row["copy_gb_per_s"] is None else f"{row['copy_gb_per_s']:.1f}"
    way = row["way"]
    if "register_threads" in row:
        way += f" x{row['register_threads']} {row['huge_pages']} {row['registration_bytes'] / 2**30:g}G"
    phases = (f"  touch {row['touch_seconds']:.2f} s, register {row['register_seconds']:.2f} s"
              if "touch_seconds" in row else "")
    print(f"{way:>24} {row['requested_bytes'] / 2**30:6.1f} GiB {row['seconds']:7.2f} s "
          f"{row['ready_gb_per_s']:6.2f} GB/s  resident +{row['resident_growth_bytes'] / 2**30:6.2f} GiB "
          f"({row['resident_growth_bytes'] / row['requested_bytes']:.3f}x)  copy {copy} GB/s{phases}", flush=True)


def main(argv):
    del argv
    name = gpu_name()
    if name is None:
        print("no GPU: measuring mapping and touching only (no pinning, no copies)")
    copy_bytes = int(FLAGS.copy_gib * 2**30)
    rows = []
    for gib in FLAGS.gib:
        nbytes = int(float(gib) * 2**30)
        if name is not None and nbytes < copy_bytes:
            raise app.UsageError(f"--gib: {gib} is smaller than --copy_gib")
        for way in FLAGS.ways:
            if way not in ("torch", "vllm", "kvoffload"):
                raise app.UsageError(f"--ways: unknown way {way!r}")
            for options in (kvoffload_options() if way == "kvoffload" else [None]):
                rows.append(run(way, nbytes, name is not None, copy_bytes, options))
                print_row(rows[-1])
    out = FLAGS.out
    if out is None and name is not None:
        slug = "h200" if "H200" in name else name.lower().replace(" ", "_")
        out = f"bench/results/host_pool_{slug}.json"
    if out:
        config = dict(gib=[float(g) for g in FLAGS.gib], copy_gib=FLAGS.copy_gib, ways=FLAGS.ways,
                      register_threads=[int(t) for t in FLAGS.register_threads],
                      huge_pages=FLAGS.huge_pages, registration_gib=FLAGS.registration_gib)
        common.write_result(out, rows, common.machine(mem_total_bytes=used_bytes() + _available()), **config)

def _available():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


if __name__ == "__main__":
    app.run(main)
