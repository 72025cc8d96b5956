"""Soak: mixed store and load jobs at full rate for minutes, every block checksummed.

  bazel run //bench:soak -- --seconds=180 --out=bench/results/soak_<gpu>.json

A Llama-3.1-8B-shaped cache (64 tensors of 32 KiB pages) of random bytes, a chunk-major
pool, and random jobs of 8 to 256 blocks, up to --in_flight at once, in both directions
on overlapping blocks and chunks (the handler orders what conflicts). A model applies
every job in submission order to per-page checksums; every --check_seconds the jobs in
flight drain and every GPU page and pool page is hashed on the GPU and compared. Prints
jobs, bytes, GB/s, failures, and host RSS and GPU memory over time: both must stay flat.
"""

import resource
import sys
import time

import numpy as np
from absl import app, flags

from kvoffload.jobs.handler import OffloadHandler
from kvoffload.pages.planner import CPUSpec, GPUSpec

import common

FLAGS = flags.FLAGS
flags.DEFINE_integer("seconds", 180, "How long to run.")
flags.DEFINE_integer("check_seconds", 30, "Drain and compare every checksum this often.")
flags.DEFINE_integer("gpu_blocks", 4096, "GPU blocks per tensor.")
flags.DEFINE_integer("cpu_chunks", 2048, "CPU chunks (one block each).")
flags.DEFINE_integer("in_flight", 8, "Jobs in flight at most.")
flags.DEFINE_string("method", "auto", "The handler's copy method.")
flags.DEFINE_string("out", "", "Write the figures as JSON here (relative to the workspace).")

TENSORS, PAGE = 64, 32 << 10


def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class PageHashes:
    """A linear hash (wrapping int64) of every page of uint8 [rows, TENSORS, PAGE] GPU
    tensors, or of host tensors copied up in slices."""

    def __init__(self, torch, rows_per_slice=256):
        self.torch, self.rows = torch, rows_per_slice
        self.weights = torch.randint(-(2**62), 2**62, (PAGE // 8,), dtype=torch.int64, device="cuda")

    def __call__(self, pages):
        out = []
        for i in range(0, pages.shape[0], self.rows):
            words = pages[i : i + self.rows].cuda().view(self.torch.int64)
            out.append((words * self.weights).sum(-1).cpu().numpy())
        return np.concatenate(out)


def main(argv):
    del argv
    import torch

    if not torch.cuda.is_available():
        sys.exit("soak: needs a CUDA GPU")
    rng = np.random.default_rng(0)
    blocks, chunks = FLAGS.gpu_blocks, FLAGS.cpu_chunks
    cache = torch.randint(0, 256, (TENSORS, blocks, PAGE), dtype=torch.uint8, device="cuda")
    handler = OffloadHandler([list(cache)], chunks, 1, method=FLAGS.method, cpu_layout="chunk_major")
    handler.pool.tensor.zero_()
    pool = handler.pool.tensor[: chunks * TENSORS * PAGE].view(chunks, TENSORS, PAGE)
    hashes = PageHashes(torch)
    gpu_model = hashes(cache.transpose(0, 1))  # [blocks, TENSORS]
    cpu_model = np.zeros((chunks, TENSORS), np.int64)  # the hash of zeros

    def check():
        nonlocal checking
        began = time.perf_counter()
        bad_gpu = int((hashes(cache.transpose(0, 1)) != gpu_model).sum())
        bad_cpu = int((hashes(pool) != cpu_model).sum())
        assert bad_gpu == 0 and bad_cpu == 0, f"{bad_gpu} GPU pages and {bad_cpu} CPU pages differ"
        checking += time.perf_counter() - began

    pending, submitted, finished, failed, moved, checks, checking = [], 0, 0, 0, 0, 0, 0.0
    samples = []
    start = last_check = time.perf_counter()
    while time.perf_counter() - start < FLAGS.seconds:
        n = int(rng.integers(8, 257))
        ids, chunk_ids = common.random_ids(rng, n, blocks), common.random_ids(rng, n, chunks)
        gpu, cpu = GPUSpec(ids, [n], [0]), CPUSpec(chunk_ids)
        if rng.random() < 0.5:
            handler.store(submitted, gpu, cpu)
            cpu_model[chunk_ids] = gpu_model[ids]
        else:
            handler.load(submitted, cpu, gpu)
            gpu_model[ids] = cpu_model[chunk_ids]
        pending.append(submitted)
        submitted += 1
        if len(pending) >= FLAGS.in_flight:
            handler.wait([pending.pop(0)])
        for r in handler.get_finished():
            finished += 1
            failed += not r.success
            moved += r.bytes
        if time.perf_counter() - last_check >= FLAGS.check_seconds:
            handler.wait(pending)
            pending.clear()
            check()
            checks += 1
            elapsed = time.perf_counter() - start
            samples.append(dict(seconds=round(elapsed, 1), jobs=submitted, gb_moved=moved / 1e9,
                                rss_mib=round(rss_mib(), 1),
                                gpu_allocated_mib=torch.cuda.memory_allocated() / 2**20,
                                gpu_used_mib=(lambda f, t: (t - f) / 2**20)(*torch.cuda.mem_get_info())))
            print(samples[-1], flush=True)
            last_check = time.perf_counter()
    handler.wait(pending)
    for r in handler.get_finished():
        finished += 1
        failed += not r.success
        moved += r.bytes
    check()
    checks += 1
    wall = time.perf_counter() - start - checking  # copying time, checks left out
    handler.shutdown()
    figures = dict(jobs_submitted=submitted, jobs_finished=finished, jobs_failed=failed,
                   bytes_moved=moved, seconds=wall, gb_per_s=moved / wall / 1e9,
                   checks=checks, pages_checked_each=int(blocks * TENSORS + chunks * TENSORS),
                   peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, samples=samples)
    print(f"soak: {submitted} jobs, {finished} finished, {failed} failed, {moved / 1e12:.2f} TB in "
          f"{wall:.0f} s ({figures['gb_per_s']:.1f} GB/s, checksums compared {checks} times)")
    assert submitted == finished and failed == 0
    if FLAGS.out:
        common.write_result(FLAGS.out, [figures], common.machine(), method=FLAGS.method)

if __name__ == "__main__":
    app.run(main)
