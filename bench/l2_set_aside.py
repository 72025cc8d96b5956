"""What a staging ring held in persisting L2 (kv.Pages(slots_in_l2=True)) costs a model
that is not copying: the decode loop's step (kvoffload.meter.compute_loop) with the device's
persisting set-aside as the ring's store leaves it, and with none, alternating.

  bazel run //bench:l2_set_aside -- --out=bench/results/l2_set_aside_<gpu>.json
"""

import ctypes
import ctypes.util
import glob
import os

import numpy as np
from absl import app, flags

import common

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 6, "Windows of each kind, alternating.")
flags.DEFINE_integer("steps", 400, "Steps a window.")
flags.DEFINE_integer("slot_mib", 16, "The ring's two slots, MiB each.")
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")

PERSISTING_L2_LIMIT = 0x06  # cudaLimitPersistingL2CacheSize


def cudart(torch):
    """The CUDA runtime torch loaded, for the two calls torch does not wrap."""
    here = os.path.dirname(torch.__file__)
    patterns = ("lib/libcudart.so*", "../nvidia/cu*/lib/libcudart.so*", "../nvidia/cuda_runtime/lib/libcudart.so*")
    for pattern in patterns:
        found = sorted(glob.glob(os.path.join(here, pattern)))
        if found:
            return ctypes.CDLL(found[0])
    return ctypes.CDLL(ctypes.util.find_library("cudart"))


def main(argv):
    del argv
    import torch

    import kvoffload as kv
    from kvoffload.meter import compute_loop

    rt = cudart(torch)
    loop = compute_loop.ComputeLoop(torch, "decode")
    loop._steps(int(8.0 / loop.step_seconds))
    tensors = [[torch.randint(0, 127, (4096, 4096), dtype=torch.int8, device="cuda") for _ in range(64)]]
    method = kv.Pages(kv.PagePath.STAGED, slot_bytes=FLAGS.slot_mib << 20, slots=2, slots_in_l2=True)
    handler = kv.OffloadHandler(tensors, num_cpu_chunks=64, blocks_per_chunk=64, method=method)
    store = kv.GPUSpec(list(range(4096)), group_sizes=(4096,), block_indices=(0,))
    job = iter(range(1 << 30))

    def store_once():
        name = f"store-{next(job)}"
        handler.store(name, store, kv.CPUSpec(list(range(64))))
        handler.wait([name])

    store_once()
    held = ctypes.c_size_t()
    assert rt.cudaDeviceGetLimit(ctypes.byref(held), PERSISTING_L2_LIMIT) == 0
    rows = []
    for r in range(FLAGS.rounds):
        for kind in ("set_aside", "none"):
            if kind == "none":
                assert rt.cudaDeviceSetLimit(PERSISTING_L2_LIMIT, ctypes.c_size_t(0)) == 0
                assert rt.cudaCtxResetPersistingL2Cache() == 0
            else:
                assert rt.cudaDeviceSetLimit(PERSISTING_L2_LIMIT, held) == 0
                store_once()  # its gather marks the slots persisting again
            torch.cuda.synchronize()
            step = float(np.mean(loop._steps(FLAGS.steps)))
            rows.append(dict(round=r, kind=kind, step_seconds=step))
            print(f"round {r} {kind:<9} {step * 1e3:.4f} ms a step")
    mean = {k: float(np.mean([row["step_seconds"] for row in rows if row["kind"] == k]))
            for k in ("set_aside", "none")}
    pairs = [a["step_seconds"] / b["step_seconds"] - 1 for a, b in zip(rows[::2], rows[1::2])]
    print(f"set-aside of {held.value >> 20} MiB: step {mean['set_aside'] / mean['none'] - 1:+.3%} "
          f"(rounds {min(pairs):+.3%} to {max(pairs):+.3%})")
    handler.shutdown()
    if FLAGS.out:
        common.write_result(FLAGS.out, rows, common.machine(), workload="decode", slot_bytes=FLAGS.slot_mib << 20,
                            slots=2, set_aside_bytes=held.value, steps=FLAGS.steps,
                            slowdown=mean["set_aside"] / mean["none"] - 1, by_round=pairs)

if __name__ == "__main__":
    app.run(main)
