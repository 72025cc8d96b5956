"""What draining a staging slot with a kernel costs the DMA beside a model loop.

  bazel run //bench:slot_drain -- --out=bench/results/slot_drain_h200.json

64 MiB DMAs between a pinned host buffer and two device slots, back to back: alone, with a
kernel reading each slot after its DMA (the staged path's shape: the next DMA into a slot
waits for its kernel) on a stream of high priority or of the default one, and bulk 1 GiB
copies as the reference. Each runs alone and beside the model loop
(kvoffload.compute_loop), in turn, twice. Without a GPU it says so and exits.
"""

import datetime
import json
import os

from absl import app, flags

import kvoffload as kv
from kvoffload import compute_loop

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "", "Write the results as JSON here (relative to the workspace).")
flags.DEFINE_integer("rounds", 2, "Times each case runs, in turn with the others.")

SLOT = 64 << 20
SLOTS = 64  # DMAs per measurement: 4 GiB


class Slots:
    """Two device slots filled (load) or emptied (store) by DMA, each drained by a kernel
    on ``drain_stream`` (or not drained)."""

    def __init__(self, torch):
        self.torch = torch
        self.host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        self.ring = torch.empty(2 * SLOT, dtype=torch.uint8, device="cuda")
        self.bulk = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        self.scratch = torch.empty(SLOT // 4, dtype=torch.float32, device="cuda")
        self.stream = torch.cuda.Stream()
        self.full = [torch.cuda.Event() for _ in range(2)]
        self.free = [torch.cuda.Event() for _ in range(2)]

    def enqueue(self, direction, drain_stream=None, bulk=False):
        """Enqueues the case's copies on self.stream; returns the bytes they move."""
        torch = self.torch
        size, count = ((1 << 30), 4) if bulk else (SLOT, SLOTS)
        for i in range(count):
            host = self.host.data_ptr() + (i * size) % (1 << 30)
            dev = self.bulk.data_ptr() if bulk else self.ring.data_ptr() + (i % 2) * SLOT
            src, dst = (host, dev) if direction == "load" else (dev, host)
            if drain_stream is not None:
                self.stream.wait_event(self.free[i % 2])
            kv.batch_copy([src], [dst], [size], self.stream, per_copy=bulk, registry=kv.UNCHECKED)
            if drain_stream is not None:
                self.full[i % 2].record(self.stream)
                drain_stream.wait_event(self.full[i % 2])
                with torch.cuda.stream(drain_stream):
                    slot = self.ring[(i % 2) * SLOT:(i % 2 + 1) * SLOT].view(torch.float32)
                    torch.mul(slot, 1.0, out=self.scratch)
                self.free[i % 2].record(drain_stream)
        if drain_stream is not None:
            self.stream.wait_stream(drain_stream)
        return size * count

    def alone_seconds(self, direction, **case):
        torch = self.torch
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda.synchronize()
        start.record(self.stream)
        nbytes = self.enqueue(direction, **case)
        end.record(self.stream)
        end.synchronize()
        return nbytes, start.elapsed_time(end) / 1e3


def main(argv):
    del argv
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return
    slots = Slots(torch)
    loop = compute_loop.ComputeLoop(torch, "model")
    cases = {
        "bulk": dict(bulk=True),
        "slots": dict(),
        "slots+kernel (priority -1)": dict(drain_stream=torch.cuda.Stream(priority=-1)),
        "slots+kernel (priority 0)": dict(drain_stream=torch.cuda.Stream(priority=0)),
    }
    rows = []
    for direction in ("load", "store"):
        for _ in range(FLAGS.rounds):
            bulk_rate = None
            for name, case in cases.items():
                nbytes, seconds = slots.alone_seconds(direction, **case)
                got = loop.beside(slots.stream, lambda: slots.enqueue(direction, **case), nbytes, seconds)
                if got is None:
                    continue
                bulk_rate = bulk_rate or got.gb_per_s  # bulk runs first
                rows.append(dict(method=name, direction=dict(load="h2d", store="d2h")[direction],
                                 block_bytes=(1 << 30) if name == "bulk" else SLOT,
                                 gb_per_s=nbytes / seconds / 1e9, workload="model",
                                 gb_per_s_beside=got.gb_per_s, ratio_beside_to_bulk=got.gb_per_s / bulk_rate,
                                 step_slowdown=got.step_slowdown, idle_drift=got.idle_drift,
                                 steps_in_window=got.steps_in_window))
                print(f"{name:<28} {direction:<5} alone {nbytes / seconds / 1e9:5.1f} GB/s, beside the model "
                      f"{got.gb_per_s:5.1f} GB/s ({got.gb_per_s / bulk_rate:.0%} of bulk beside), step "
                      f"slowdown {got.step_slowdown:+.1%} (idle drift {got.idle_drift:+.1%})", flush=True)
    if FLAGS.out:
        out = FLAGS.out
        if not os.path.isabs(out) and "BUILD_WORKSPACE_DIRECTORY" in os.environ:
            out = os.path.join(os.environ["BUILD_WORKSPACE_DIRECTORY"], out)
        with open(out, "w") as f:
            json.dump(dict(date=datetime.date.today().isoformat(),
                           machine=dict(device=torch.cuda.get_device_name()),
                           config=dict(slot_bytes=SLOT, slots=2, dmas=SLOTS, drain="torch.mul over the slot"),
                           rows=rows), f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    app.run(main)
