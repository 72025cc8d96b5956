"""Two GPUs: one handler per device, both busy at once; a tensor on one device with a
stream of the other is refused; a process that uses only the second GPU starts no
context on the first."""

import concurrent.futures
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload.jobs.handler import OffloadHandler
from kv_model import make_handler, soak
from scatter import POISON
from scale import scaled
from calibrated import quick_calibration  # noqa: F401 - autouse


pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.parametrize("method", ["pages", "auto", "batch", "kernel", "staged"])
def test_one_handler_per_device_both_at_once(method):
    def run(device):
        rng = np.random.default_rng(device)
        handler, model = make_handler(rng, [2048, 1024], [4, 2], num_blocks=96, num_chunks=80, bpc=2,
                                      cpu_layout="chunk_major", device=f"cuda:{device}", method=method)
        soak(handler, model, rng, jobs=scaled(1500, 100), max_in_flight=32)
        handler.shutdown()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(run, d) for d in (0, 1)]:
            done.result()


def test_copy_blocks_with_a_stream_of_the_other_device_is_refused():
    src = torch.randint(0, 256, (8, 4096), dtype=torch.uint8, device="cuda:0")
    dst = torch.full((8, 4096), POISON, dtype=torch.uint8, device="cuda:0")
    other = torch.cuda.Stream("cuda:1")
    with pytest.raises(ValueError, match=r"stream: is on device 1 but src is on device 0"):
        kv.copy_blocks(src, dst, np.array([[0, 1]]), other)
    host = torch.randint(0, 256, (8, 4096), dtype=torch.uint8).pin_memory()
    with pytest.raises(ValueError, match=r"stream: is on device 1 but dst is on device 0"):
        kv.copy_blocks(host, dst, np.array([[0, 1]]), other)
    torch.cuda.synchronize("cuda:0")
    assert (dst.cpu() == POISON).all()


@pytest.mark.parametrize("copy", ["kernel", "staged"])
def test_pointers_of_one_device_with_a_stream_of_the_other_are_refused(copy):
    device = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda:0")
    host = torch.full((1 << 20,), POISON, dtype=torch.uint8).pin_memory()
    offsets = np.arange(8, dtype=np.int64) * 4096
    args = (offsets + device.data_ptr(), offsets + host.data_ptr(), np.full(8, 4096))
    stream = torch.cuda.Stream("cuda:1")
    with pytest.raises(ValueError, match=r"src\[0\]: 0x[0-9a-f]+ is memory of device 0, but the stream is on device 1"):
        if copy == "kernel":
            kv.kernel_copy(*args, stream=stream, registry=kv.UNCHECKED)
        else:
            kv.staged_copy(*args, direction="store", stream=stream, registry=kv.UNCHECKED)
    assert (host == POISON).all()


def test_a_handler_rejects_tensors_on_two_devices():
    gpu = [[torch.zeros((8, 256), dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 1)]]
    with pytest.raises(ValueError, match=r"gpu_tensors: expected one device, got \['cuda:0', 'cuda:1'\]"):
        OffloadHandler(gpu, 4, 2)


# Run in a fresh process: a context on device 0, once made, stays. The handler's threads
# (its enqueue thread, the pool's pinning threads) start with device 0 current.
_ONLY_DEVICE_1 = """
import ctypes, os, sys
import numpy as np, torch
sys.path.insert(0, os.getcwd())
from kv_model import make_handler, soak

cuda = ctypes.CDLL("libcuda.so.1")

def active(device):
    flags, state = ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(state)) == 0
    return state.value

rng = np.random.default_rng(5)
torch.empty(1, device="cuda:1")
print("before:", active(0), active(1))
handler, model = make_handler(rng, [2048, 1024], [4, 2], num_blocks=32, num_chunks=24, bpc=2,
                              cpu_layout="chunk_major", device="cuda:1", expedited_loads=True)
soak(handler, model, rng, jobs=40, max_in_flight=8)
handler.shutdown()
print("after:", active(0), active(1))
"""


def test_a_process_on_device_1_starts_no_context_on_device_0():
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", _ONLY_DEVICE_1], cwd=here, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "before: 0 1" in run.stdout, run.stdout  # torch itself left device 0 alone
    assert "after: 0 1" in run.stdout, run.stdout + run.stderr[-3000:]
