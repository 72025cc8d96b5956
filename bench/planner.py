"""Planner benchmark: plans a transfer of 8,192 blocks x 64 layers x K/V (1M pages) with
the page table (prepare, then transfer_plan) and times the straightforward per-block loop
on the same transfer.

  bazel run //bench:planner
"""

import os
import sys
import time

import numpy as np
from absl import app, flags

from kvoffload import Direction
from kvoffload.copy.registry import MemoryRegistry
from kvoffload.pages.planner import CPUSpec, GPUSpec, GroupLayout, KVLayout, TensorLayout, chunks_used
from kvoffload.pages.table import job_arguments, page_table, transfer_plan

import common

try:
    from planner_reference import plan_per_block
except ImportError:  # run as bench/planner.py, not through Bazel: the oracle is in tests/
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from planner_reference import plan_per_block

FLAGS = flags.FLAGS
flags.DEFINE_integer("blocks", 8192, "GPU blocks in the transfer.")
flags.DEFINE_integer("layers", 64, "Layers; each has a K and a V tensor.")
flags.DEFINE_integer("page_bytes", 16 << 10, "Bytes per block and tensor.")
flags.DEFINE_integer("blocks_per_chunk", 16, "Blocks per CPU chunk.")
flags.DEFINE_integer("first_index", 5, "Logical index of the first block (unaligned by default).")
flags.DEFINE_integer("repeats", 5, "Timed plans; the best is kept.")


def layout_from_integers(tensors, blocks, chunks, page, bpc):
    """Addresses only: each tensor its own GPU region and CPU region (vLLM's layout)."""
    gpu_span, cpu_span = blocks * page, chunks * bpc * page
    return KVLayout((GroupLayout(tuple(
        TensorLayout(gpu_base=(1 << 40) + t * gpu_span, gpu_stride=page, page_bytes=page,
                     cpu_base=(1 << 44) + t * cpu_span, cpu_stride=bpc * page)
        for t in range(tensors)), blocks, chunks),), bpc)


def best_seconds(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv):
    del argv
    rng = np.random.default_rng(0)
    bpc, n = FLAGS.blocks_per_chunk, FLAGS.blocks
    chunks = chunks_used(n, FLAGS.first_index, bpc)
    layout = layout_from_integers(2 * FLAGS.layers, 2 * n, 2 * chunks, FLAGS.page_bytes, bpc)
    gpu = GPUSpec(common.random_ids(rng, n, 2 * n), [n], [FLAGS.first_index])
    cpu = CPUSpec(common.random_ids(rng, chunks, 2 * chunks))

    table = page_table(layout)
    ids = job_arguments(gpu, cpu)
    plan = transfer_plan(table, table.prepare(*ids), Direction.STORE)
    prepared = best_seconds(lambda: table.prepare(*ids), FLAGS.repeats)
    planned = best_seconds(lambda: transfer_plan(table, table.prepare(*ids), Direction.STORE), FLAGS.repeats)
    pages = len(plan_per_block(layout, gpu, cpu))
    loop = best_seconds(lambda: plan_per_block(layout, gpu, cpu), 1)
    registry = MemoryRegistry()
    for t, tensor in enumerate(layout.groups[0].tensors):
        registry.register(f"gpu {t}", tensor.gpu_base, 2 * n * tensor.gpu_stride, "device")
        registry.register(f"cpu {t}", tensor.cpu_base, 2 * chunks * tensor.cpu_stride, "host")
    checked = best_seconds(lambda: (registry.check(plan.gpu, plan.sizes, "device"),
                                    registry.check(plan.cpu, plan.sizes, "host")), FLAGS.repeats)
    print(f"transfer: {n} blocks x {2 * FLAGS.layers} tensors of {FLAGS.page_bytes} bytes, "
          f"blocks_per_chunk {bpc}, first index {FLAGS.first_index}")
    print(f"per job: {pages} pages, {plan.descriptors} descriptors ({plan.total_bytes / 2**30:.1f} GiB)")
    print(f"prepare + transfer_plan: {planned * 1e3:.1f} ms ({pages / planned / 1e6:.1f} M pages/s); "
          f"prepare alone {prepared * 1e3:.2f} ms")
    print(f"per-block loop:  {loop * 1e3:.1f} ms ({pages / loop / 1e6:.2f} M pages/s)")
    print(f"registered-memory check of both sides: {checked * 1e3:.2f} ms for the {plan.descriptors} "
          f"descriptors ({len(registry.regions)} regions)")
    print(f"page table: {pages} pages in {planned * 1e3:.1f} ms, "
          f"{loop / planned:.0f}x faster than the per-block loop")

if __name__ == "__main__":
    app.run(main)
