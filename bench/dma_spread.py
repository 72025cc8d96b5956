"""How the span of memory a copy engine's copies touch sets its rate beside the model.

  bazel run //bench:dma_spread -- --probe=spread --out=bench/results/dma_address_spread_<gpu>.json

Raw kvoffload.copy.batch_copy calls of 512 MiB jobs (two in flight per stream), alone and on
kvoffload.meter beside the Llama-shaped layer loop, with bulk copies as the reference.
``spread``: copies of one size between a 2 GiB device buffer and a 2 GiB pinned host
buffer, each side contiguous or scattered (over the whole buffer or its first 256
MiB), on 1, 2 or 4 streams. ``order``: vLLM's 64 KiB x 32 layout (32 device tensors of
2048 blocks, a chunk-major host pool of 2 MiB chunks, jobs of 256 random blocks to
random chunks) with its copies in several orders. A source's name says what it is;
docs/studies.md#dma-address-spread reads them. Without a GPU there is nothing to
measure, and it says so.
"""

import os

import numpy as np
from absl import app, flags

import common

FLAGS = flags.FLAGS
flags.DEFINE_enum("probe", "spread", ["spread", "order"], "Which set of sources to measure.")
flags.DEFINE_list("sources", [], "Only the sources whose names start with one of these (bulk always).")
flags.DEFINE_string("out", "", "Write the rows as JSON here (relative to the workspace).")

POOL = 2 << 30
JOB = 512 << 20
PAGE, TENSORS, BLOCKS, BLOCKS_A_JOB = 64 << 10, 32, 2048, 256


class Together:
    """Several sources kept in flight as one."""

    def __init__(self, parts):
        self.parts = parts

    def top_up(self):
        for p in self.parts:
            p.top_up()

    def drain(self):
        return sum(p.drain() for p in self.parts)


def raw_source(torch, s, d, sizes, streams=1, call_bytes=64 << 20, depth=2):
    """copies s[i] -> d[i] as batch_copy calls of about call_bytes, split over streams."""
    import kvoffload as kv
    from kvoffload.meter.sources import RawCopies, in_calls
    parts, count = [], len(sizes)
    for k in range(streams):
        stream = torch.cuda.Stream()
        cut = slice(k * count // streams, (k + 1) * count // streams)
        copy = lambda a, b, z, st=stream: kv.batch_copy(a, b, z, st, registry=kv.UNCHECKED)
        parts.append(RawCopies(torch, in_calls(copy, s[cut], d[cut], sizes[cut], call_bytes // streams), stream, depth))
    made = Together(parts)
    return lambda: made


def spread_sources(torch, rng):
    from kvoffload.meter.sources import BulkCopies
    gpu = torch.empty(POOL, dtype=torch.uint8, device="cuda")
    host = torch.empty(POOL, dtype=torch.uint8, pin_memory=True)

    def offsets(count, block, contiguous, span):
        if contiguous:
            return np.arange(count, dtype=np.int64) * block
        reps = -(-count * block // span)
        return np.concatenate([rng.permutation(span // block) for _ in range(reps)])[:count].astype(np.int64) * block

    def source(direction, block, streams=1, contiguous=False, sort=False, depth=2, gc=None, hc=None,
               gspan=POOL, hspan=POOL):
        count = JOB // block
        g = offsets(count, block, contiguous if gc is None else gc, gspan) + gpu.data_ptr()
        h = offsets(count, block, contiguous if hc is None else hc, hspan) + host.data_ptr()
        if sort:
            o = np.argsort(g)
            g, h = g[o], h[o]
        s, d = (g, h) if direction == "store" else (h, g)
        return raw_source(torch, s, d, np.full(count, block, dtype=np.int64), streams, depth=depth)

    k64 = 64 << 10
    return {
        "bulk store": (lambda b=BulkCopies(torch, "store", JOB): b),
        "bulk load": (lambda b=BulkCopies(torch, "load", JOB): b),
        "64k store s1": source("store", k64),
        "64k store s2": source("store", k64, 2),
        "64k store s4": source("store", k64, 4),
        "64k store s1 depth4": source("store", k64, depth=4),
        "64k store s1 sorted": source("store", k64, sort=True),
        "64k store s1 contiguous": source("store", k64, contiguous=True),
        "256k store s1": source("store", 256 << 10),
        "1m store s1": source("store", 1 << 20),
        "64k load s1": source("load", k64),
        "64k load s2": source("load", k64, 2),
        "64k store gscat hcont": source("store", k64, gc=False, hc=True),
        "64k store gcont hscat": source("store", k64, gc=True, hc=False),
        "64k store gscat256m hcont": source("store", k64, gc=False, hc=True, gspan=256 << 20),
        "64k store gcont hscat256m": source("store", k64, gc=True, hc=False, hspan=256 << 20),
        "64k load gscat hcont": source("load", k64, gc=False, hc=True),
        "64k load gcont hscat": source("load", k64, gc=True, hc=False),
    }


def order_sources(torch, rng):
    from kvoffload.meter.sources import BulkCopies
    from kvoffload.pool.host_pool import HostPool
    chunk = PAGE * TENSORS
    tensors = [torch.empty(BLOCKS * PAGE, dtype=torch.uint8, device="cuda") for _ in range(TENSORS)]
    bases = np.array([t.data_ptr() for t in tensors], np.int64)
    pinned = torch.empty(BLOCKS * chunk, dtype=torch.uint8, pin_memory=True)
    pool = HostPool(BLOCKS * chunk)
    pool.wait()
    hosts = {"torch": pinned.data_ptr(), "pool": pool.tensor.data_ptr()}

    def source(direction, order, sort=None, host="torch"):
        g, h = [], []
        for _ in range(8):  # jobs taken in turn
            blocks = common.random_ids(rng, BLOCKS_A_JOB, BLOCKS)
            chunks = common.random_ids(rng, BLOCKS_A_JOB, BLOCKS)
            if sort is not None:
                o = np.argsort(blocks if sort == "block" else chunks)
                blocks, chunks = blocks[o], chunks[o]
            gg = bases[None, :] + blocks[:, None] * PAGE  # [block, tensor]
            hh = hosts[host] + chunks[:, None] * chunk + np.arange(TENSORS)[None, :] * PAGE
            if order == "tensor":
                gg, hh = gg.T, hh.T
            g.append(gg.ravel())
            h.append(hh.ravel())
        g, h = np.concatenate(g), np.concatenate(h)
        s, d = (g, h) if direction == "store" else (h, g)
        return raw_source(torch, s, d, np.full(len(g), PAGE, np.int64), call_bytes=BLOCKS_A_JOB * chunk)

    return {
        "bulk store": (lambda b=BulkCopies(torch, "store", BLOCKS_A_JOB * chunk): b),
        "store block-major": source("store", "block"),
        "store block-major pool": source("store", "block", host="pool"),
        "store tensor-major": source("store", "tensor"),
        "store tensor-major by-block": source("store", "tensor", "block"),
        "store block-major by-block": source("store", "block", "block"),
        "store block-major by-chunk": source("store", "block", "chunk"),
        "store tensor-major by-chunk": source("store", "tensor", "chunk"),
        "load block-major": source("load", "block"),
        "load tensor-major by-block": source("load", "tensor", "block"),
    }


def main(argv):
    del argv
    import torch

    if not torch.cuda.is_available():
        print("no GPU: this probe measures copy engines beside a model on the GPU; nothing to run")
        return
    from kvoffload.meter import compute_loop, meter
    rng = np.random.default_rng(0 if FLAGS.probe == "spread" else 1)
    sources = (spread_sources if FLAGS.probe == "spread" else order_sources)(torch, rng)
    if FLAGS.sources:
        sources = {k: v for k, v in sources.items()
                   if k.startswith("bulk") or any(k.startswith(p) for p in FLAGS.sources)}
    alone = {k: meter.alone(make(), 0.5) for k, make in sources.items()}
    for k, rate in alone.items():
        print(f"{k:<30} alone {rate:6.1f} GB/s")
    got = meter.measure(compute_loop.ComputeLoop(torch, "model"), sources)
    rows = []
    for k, r in got.items():
        print(f"{k:<30} beside {r.summary()}")
        rows.append(dict(probe=FLAGS.probe, source=k, gb_per_s=alone[k], gb_per_s_beside=r.gb_per_s,
                         step_slowdown=r.step_slowdown, idle_drift=r.idle_drift, noisy=r.noisy,
                         connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"), process=os.getpid()))
    if FLAGS.out:
        common.write_result(FLAGS.out, rows, common.machine(), probe=FLAGS.probe)


if __name__ == "__main__":
    app.run(main)
