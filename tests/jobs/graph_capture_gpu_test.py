"""CUDA graph capture: a copy queued on a capturing stream is recorded, not run, and the
driver's batch copy is not even recorded. So every job and copy call refuses a capturing
stream by name, before anything is queued, and leaves the capture whole; a capture on
another thread leaves jobs copying right. Every method, on random data, outputs poisoned."""

import threading

import numpy as np
import pytest
import torch

from kvoffload import _C, CPUSpec, GPUSpec, OffloadHandler

from kvoffload.jobs import methods as job_methods

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
METHODS = [m for m in job_methods.NAMES if m != "auto"]  # auto's calibration is auto_gpu_test's
LAYERS, BLOCKS, PAGE, CHUNKS = 4, 32, 8192, 16
CAPTURING = "is capturing a CUDA graph"


def one_allocation(rng):
    """vLLM's LBHNC: every layer's [blocks, page] in one buffer, so "pages" moves rows."""
    backing = torch.from_numpy(rng.integers(0, 256, LAYERS * BLOCKS * PAGE, dtype=np.uint8)).cuda()
    return backing, [[backing[i * BLOCKS * PAGE:(i + 1) * BLOCKS * PAGE].view(BLOCKS, PAGE) for i in range(LAYERS)]]


def round_trip(handler, gpu, rng, tag):
    """Stores random blocks, poisons them, loads them back: the bytes must match."""
    ids = rng.permutation(BLOCKS)[:8].astype(np.int64)
    chunks = rng.permutation(CHUNKS)[:8].astype(np.int64)
    want = [t[torch.from_numpy(ids).cuda()].clone() for t in gpu[0]]
    assert handler.store(f"{tag} store", GPUSpec(ids, [8], [0]), CPUSpec(chunks))
    handler.wait([f"{tag} store"])
    for t in gpu[0]:
        t[torch.from_numpy(ids).cuda()] = 0xA5
    assert handler.load(f"{tag} load", CPUSpec(chunks), GPUSpec(ids, [8], [0]))
    handler.wait([f"{tag} load"])
    results = handler.get_finished()
    return results, [torch.equal(t[torch.from_numpy(ids).cuda()], w) for t, w in zip(gpu[0], want)]


@pytest.mark.parametrize("method", METHODS)
def test_a_job_submitted_in_a_capture_raises_and_the_capture_stays_whole(method):
    rng = np.random.default_rng(len(method))
    _, gpu = one_allocation(rng)
    handler = OffloadHandler(gpu, CHUNKS, 1, method=method)
    try:
        x = torch.ones(1 << 16, device="cuda")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x * 3
            with pytest.raises(ValueError, match="current stream: " + CAPTURING):
                handler.store("captured", GPUSpec([1, 2], [2], [0]), CPUSpec([0, 1]))
            with pytest.raises(ValueError, match="current stream: " + CAPTURING):
                handler.load("captured", CPUSpec([0, 1]), GPUSpec([1, 2], [2], [0]))
            with pytest.raises(ValueError, match="stream: " + CAPTURING):
                handler.fence()
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(y == 3)  # the capture ended whole and runs
        assert handler.get_finished() == []  # nothing was submitted
        results, same = round_trip(handler, gpu, rng, "after")  # the ids are free, the handler works
        assert all(r.success for r in results) and all(same), (results, same)
    finally:
        handler.shutdown()


def test_copy_calls_refuse_a_capturing_stream_before_copying():
    rng = np.random.default_rng(3)
    src = torch.from_numpy(rng.integers(0, 256, (16, 4096), dtype=np.uint8)).cuda()
    dst = torch.full((16, 4096), 0xA5, dtype=torch.uint8).pin_memory()
    mapping = np.stack([np.arange(8), rng.permutation(16)[:8]], 1).astype(np.int64)
    addresses = [np.array([a], dtype=np.int64) for a in (src.data_ptr(), dst.data_ptr(), 4096)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stream = torch.cuda.current_stream()
        calls = {"copy_blocks": lambda: _C.copy_blocks(src, dst, mapping, stream),
                 "batch_copy": lambda: _C.batch_copy(*addresses, stream),
                 "kernel_copy": lambda: _C.kernel_copy(*addresses, stream),
                 "staged_copy": lambda: _C.staged_copy(*addresses, _C.Direction.STORE, stream)}
        for name, call in calls.items():
            with pytest.raises(ValueError, match="stream: " + CAPTURING):
                call()
    torch.cuda.synchronize()
    assert torch.all(dst == 0xA5)  # nothing copied, then or later
    _C.copy_blocks(src, dst, mapping, torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert torch.equal(dst[torch.from_numpy(mapping[:, 1])], src[:8].cpu())


@pytest.mark.parametrize("method", ["pages", "pages_staged", "pages_dma", "batch"])
def test_jobs_copy_right_while_another_thread_captures_in_global_mode(method):
    # torch.cuda.graph's default mode is global: other threads may not make unsafe calls
    # (an event query among them), and one that does invalidates the capture.
    rng = np.random.default_rng(11)
    _, gpu = one_allocation(rng)
    handler = OffloadHandler(gpu, CHUNKS, 1, method=method)
    ids = rng.permutation(BLOCKS)[:16].astype(np.int64)
    stored, loaded = ids[:8], ids[8:]
    chunks = rng.permutation(CHUNKS)[:8].astype(np.int64)
    want = [t[torch.from_numpy(stored).cuda()].clone() for t in gpu[0]]
    for t in gpu[0]:
        t[torch.from_numpy(loaded).cuda()] = 0xA5
    torch.cuda.synchronize()
    capturing, release = threading.Event(), threading.Event()

    captured = []

    def capture():
        x = torch.ones(1024, device="cuda")
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                x.mul_(2)
                capturing.set()
                release.wait(30)
            graph.replay()
            captured.append(x)
        finally:
            capturing.set()

    side = torch.cuda.Stream()
    thread = threading.Thread(target=capture)
    thread.start()
    try:
        assert capturing.wait(30)
        try:  # everything the store and load ask of CUDA happens while the capture is open
            # PyTorch captures on a non-blocking stream, which the legacy default stream does
            # not synchronize with: a job from the legacy stream is not part of the capture, and runs.
            handler.store("store", GPUSpec(stored, [8], [0]), CPUSpec(chunks))
            with torch.cuda.stream(side):
                handler.load("load", CPUSpec(chunks), GPUSpec(loaded, [8], [0]))
            handler.wait(["store", "load"])
        finally:
            release.set()
            thread.join(30)
        results = handler.get_finished()
    finally:
        handler.shutdown()
    torch.cuda.synchronize()
    # The lanes' event queries and waits run in relaxed capture mode: the capture survives.
    assert captured and torch.all(captured[0] == 2)
    assert len(results) == 2 and all(r.success for r in results), results
    assert all(torch.equal(t[torch.from_numpy(loaded).cuda()], w) for t, w in zip(gpu[0], want))


def test_a_job_from_the_legacy_stream_is_refused_while_a_blocking_stream_captures():
    # A blocking stream's capture takes in the legacy stream's work (CUDA answers
    # cudaErrorStreamCaptureImplicit for it), so a job from there is refused by name; the
    # capture is not invalidated, and a job from a stream of one's own runs.
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(12)
    _, gpu = one_allocation(rng)
    handler = OffloadHandler(gpu, CHUNKS, 1)
    blocking = cupy.cuda.Stream(non_blocking=False)
    capture_stream = torch.cuda.ExternalStream(blocking.ptr)
    capturing, release, captured = threading.Event(), threading.Event(), []

    def capture():
        x = torch.ones(1024, device="cuda")
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=capture_stream, capture_error_mode="relaxed"):
                x.mul_(3)
                capturing.set()
                release.wait(30)
            graph.replay()
            captured.append(x)
        finally:
            capturing.set()

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        assert capturing.wait(30)
        ids = rng.permutation(BLOCKS)[:8].astype(np.int64)
        chunks = rng.permutation(CHUNKS)[:8].astype(np.int64)
        with pytest.raises(ValueError, match="current stream: " + CAPTURING + r" \(the legacy default stream"):
            handler.store("refused", GPUSpec(ids, [8], [0]), CPUSpec(chunks))
    finally:
        release.set()
        thread.join(30)
    try:
        torch.cuda.synchronize()
        assert captured and torch.all(captured[0] == 3)
        results, same = round_trip(handler, gpu, rng, "after")
        assert all(r.success for r in results) and all(same), (results, same)
        assert "refused" not in {r.job_id for r in results}
    finally:
        handler.shutdown()
