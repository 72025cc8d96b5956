"""What a KV layout costs the model's own reads: decode attention reads each sequence's
pages of one layer at a time through a block table. Here a gather (torch.index_select
over one layer's view) reads the pages of random blocks layer by layer from vLLM's one
allocation, under LBHNC (a layer's pages a page apart) and BLHNC (a block's layers back to
back: a layer's pages a whole block apart), against the same bytes read contiguously.

  bazel run //bench:layout_reads -- --out=bench/results/layout_reads_<gpu>.json

Not attention itself (vLLM's kernels are not in the GPU image): the same page reads, by
another kernel. A ratio under 1 for BLHNC says its pages cost the model's reads more.
"""

import numpy as np
from absl import app, flags

import common

FLAGS = flags.FLAGS
# name -> (layers, blocks, page bytes): the caches of bench/vllm_caches.py's models.
MODELS = {"tp8-8k": (80, 8192, 8 << 10), "4k": (64, 8192, 4 << 10), "llama8b-64k": (32, 2048, 64 << 10)}
flags.DEFINE_list("models", list(MODELS), "Caches to read (MODELS).")
flags.DEFINE_float("read_share", 0.5, "The share of a layer's blocks a step reads (a decode batch's).")
flags.DEFINE_integer("repeats", 20, "Timed passes over every layer, per layout; the median is kept.")
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")

LAYOUTS = ("LBHNC", "BLHNC")


def layer_views(buffer, layers, blocks, page, layout):
    """Each layer's (blocks, page) view of one allocation in ``layout``."""
    if layout == "LBHNC":
        cache = buffer.view(layers, blocks, page)
    else:
        cache = buffer.view(blocks, layers, page).transpose(0, 1)
    return [cache[layer] for layer in range(layers)]


def seconds(torch, work, repeats):
    """Median seconds of ``work()`` on the current stream (host time without a GPU)."""
    import time
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            work()
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(torch, model, device, rng):
    layers, blocks, page = MODELS[model]
    if device == "cpu":  # a small cache: the host path checks the arithmetic, not the GPU
        layers, blocks = min(layers, 8), min(blocks, 256)
    n = max(1, int(blocks * FLAGS.read_share))
    buffer = torch.randint(0, 256, (layers * blocks * page,), dtype=torch.uint8, device=device)
    scratch = torch.empty((n, page), dtype=torch.uint8, device=device)
    ids = [torch.from_numpy(common.random_ids(rng, n, blocks)).to(device) for _ in range(layers)]
    nbytes = layers * n * page
    contiguous = buffer[:nbytes].view(layers, n, page)

    def read_contiguous():
        for layer in range(layers):
            scratch.copy_(contiguous[layer])

    rows = [dict(model=model, layout="contiguous", layers=layers, blocks=blocks, page_bytes=page, read_blocks=n,
                 gb_per_s=nbytes / seconds(torch, read_contiguous, FLAGS.repeats) / 1e9)]
    for layout in LAYOUTS:
        views = layer_views(buffer, layers, blocks, page, layout)
        # The gather reads what the views say: the first layer's pages, checked once.
        torch.index_select(views[1 % layers], 0, ids[0], out=scratch)
        want = buffer.view(layers, blocks, page)[1 % layers] if layout == "LBHNC" else \
            buffer.view(blocks, layers, page)[:, 1 % layers]
        assert torch.equal(scratch, want[ids[0]]), layout

        def read(views=views):
            for layer in range(layers):
                torch.index_select(views[layer], 0, ids[layer], out=scratch)

        rows.append(dict(rows[0], layout=layout, gb_per_s=nbytes / seconds(torch, read, FLAGS.repeats) / 1e9))
    for row in rows:
        row["vs_contiguous"] = row["gb_per_s"] / rows[0]["gb_per_s"]
        row["vs_lbhnc"] = row["gb_per_s"] / rows[1]["gb_per_s"]
        print(f"{model:<12} {row['layout']:<10} {row['gb_per_s']:8.1f} GB/s of page reads, "
              f"{row['vs_contiguous']:.2f} of contiguous, {row['vs_lbhnc']:.2f} of LBHNC")
    return rows


def main(argv):
    del argv
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("no GPU: reading a small cache on the host, not the GPU's HBM")
    rng = np.random.default_rng(0)
    rows = []
    for model in FLAGS.models:
        if model not in MODELS:
            raise ValueError(f"--models: expected names of {list(MODELS)}, got {model!r}")
        rows += measure(torch, model, device, rng)
        if device == "cuda":
            torch.cuda.empty_cache()
    if FLAGS.out:
        common.write_result(FLAGS.out, rows, common.machine(), read_share=FLAGS.read_share, repeats=FLAGS.repeats,
                            note="torch.index_select of random blocks of each layer's view, layer by layer")


if __name__ == "__main__":
    app.run(main)
