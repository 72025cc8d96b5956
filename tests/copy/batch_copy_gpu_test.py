"""kvoffload.copy.batch_copy on a GPU: every direction, stream kind and source access order,
byte for byte against the source on random data."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload import _C
from scatter import POISON, scatter

ORDER = kv.SrcAccessOrder
POOL = 4 << 20


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


@pytest.fixture
def rng():
    return np.random.default_rng(99)


def make_pool(where, data):
    host = torch.from_numpy(data)
    if where == "host":
        return host.pin_memory()
    return host.cuda()


DIRECTIONS = {"h2d": ("host", "device"), "d2h": ("device", "host"), "d2d": ("device", "device")}

# stream name -> (make the stream argument, the path it must take)
STREAMS = {
    "legacy": (lambda: None, "per_copy"),
    "legacy_handle": (lambda: 1, "per_copy"),
    "per_thread": (lambda: 2, "batch"),
    "created": (lambda: torch.cuda.Stream(), "batch"),
}


def run_copy(rng, direction, sizes, slot, stream_name="created", order=ORDER.STREAM,
             misalign=False, **kwargs):
    src_where, dst_where = DIRECTIONS[direction]
    src_bytes = rng.integers(0, 256, POOL, dtype=np.uint8)
    src = make_pool(src_where, src_bytes)
    dst = make_pool(dst_where, np.full(POOL, POISON, dtype=np.uint8))
    plan = scatter(rng, sizes, slot=slot, pool_bytes=POOL, misalign=misalign)
    make_stream, path = STREAMS[stream_name]
    stream = make_stream()
    torch.cuda.synchronize()
    s, d = plan.pointers(src.data_ptr(), dst.data_ptr())
    result = kv.batch_copy(s, d, plan.sizes, stream=stream, order=order, **kwargs, registry=kv.UNCHECKED)
    torch.cuda.synchronize()
    want = plan.expected(src_bytes, np.full(POOL, POISON, dtype=np.uint8))
    np.testing.assert_array_equal(dst.cpu().numpy(), want)
    np.testing.assert_array_equal(src.cpu().numpy(), src_bytes)
    return result, path


@pytest.mark.parametrize("direction", DIRECTIONS.keys())
@pytest.mark.parametrize("stream_name", STREAMS.keys())
@pytest.mark.parametrize("size", [8, 4096, 8192])
def test_directions_streams_and_sizes(rng, direction, stream_name, size):
    result, path = run_copy(rng, direction, np.full(200, size), slot=16384, stream_name=stream_name)
    assert result.path == path and result.copies == 200 and result.bytes == 200 * size


@pytest.mark.parametrize("direction", DIRECTIONS.keys())
def test_twenty_thousand_copies_of_128_bytes(rng, direction):
    result, _ = run_copy(rng, direction, np.full(20_000, 128), slot=128)
    assert (result.path, result.driver_calls) == ("batch", -(-20_000 // _C.COPIES_PER_DRIVER_CALL))


@pytest.mark.parametrize("direction", DIRECTIONS.keys())
@pytest.mark.parametrize("order", ["stream", "any", "mixed", "during_api_call"])
def test_source_access_orders(rng, direction, order):
    n = 500
    orders = {
        "stream": ORDER.STREAM,
        "any": ORDER.ANY,
        "during_api_call": ORDER.DURING_API_CALL,
        "mixed": rng.choice([int(ORDER.STREAM), int(ORDER.ANY)], n).astype(np.int64),
    }[order]
    result, _ = run_copy(rng, direction, rng.integers(1, 4097, n), slot=4096, order=orders,
                         misalign=True)
    assert result.path == "batch"


@pytest.mark.parametrize("stream_name", ["legacy", "created"])
def test_during_api_call_sources_are_read_before_return(rng, stream_name):
    # The source is overwritten right after the call returns; the copy must not see it.
    src_bytes = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    src = torch.from_numpy(src_bytes.copy()).pin_memory()
    dst = torch.full((1 << 20,), POISON, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()  # the fill ran: the copy's stream need not order after it
    stream = STREAMS[stream_name][0]()
    kv.batch_copy([src.data_ptr()], [dst.data_ptr()], [1 << 20], stream=stream,
                  order=ORDER.DURING_API_CALL, registry=kv.UNCHECKED)
    src.fill_(0)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(dst.cpu().numpy(), src_bytes)


@pytest.mark.parametrize("per_call", [1, 7, 1000])
def test_chunked_driver_calls(rng, per_call):
    result, _ = run_copy(rng, "h2d", np.full(1000, 256), slot=512, _max_copies_per_call=per_call)
    assert result.driver_calls == -(-1000 // per_call)


def test_requested_per_copy_path(rng):
    result, _ = run_copy(rng, "d2h", np.full(300, 1024), slot=1024, per_copy=True)
    assert (result.path, result.driver_calls) == ("per_copy", 300)
    assert "requested" in result.reason


def test_batch_entry_point_is_the_cuda_13_form():
    assert kv.batch_entry_point_version() == 13000


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_copy_blocks_between_torch_tensors(rng, direction):
    src_where, dst_where = DIRECTIONS[direction]
    src_data = rng.standard_normal((64, 16, 8)).astype(np.float32)
    src = make_pool(src_where, src_data).view(torch.bfloat16)
    dst = make_pool(dst_where, np.full((48, 16, 8), -3.0, np.float32)).view(torch.bfloat16)
    mapping = torch.from_numpy(np.stack([rng.permutation(64)[:40], rng.permutation(48)[:40]], 1))
    stream = torch.cuda.Stream()
    result = kv.copy_blocks(src, dst, mapping, stream=stream, order=ORDER.ANY)
    stream.synchronize()
    want = torch.full((48, 16, 8), -3.0).view(torch.bfloat16)
    want[mapping[:, 1]] = torch.from_numpy(src_data).view(torch.bfloat16)[mapping[:, 0]]
    assert result.path == "batch" and torch.equal(dst.cpu().view(torch.int16), want.view(torch.int16))


def test_copy_blocks_out_of_range_on_gpu_copies_nothing(rng):
    src = torch.zeros((8, 128), dtype=torch.uint8, device="cuda")
    dst = torch.full((8, 128), POISON, dtype=torch.uint8).pin_memory()
    with pytest.raises(ValueError, match=r"block_mapping\[1, 0\]: source block 8 is out of range"):
        kv.copy_blocks(src, dst, torch.tensor([[0, 0], [8, 1]]))
    torch.cuda.synchronize()
    assert (dst == POISON).all()


def test_pointer_arrays_on_the_gpu_are_rejected():
    ptrs = torch.zeros(4, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match=r"src: must be in host memory"):
        kv.batch_copy(ptrs, [1, 2, 3, 4], [1, 1, 1, 1], stream=2, registry=kv.UNCHECKED)


def test_torch_stream_and_cuda_stream_protocol_are_accepted(rng):
    class ProtocolStream:
        def __init__(self, s):
            self.s = s

        def __cuda_stream__(self):
            return (0, self.s.cuda_stream)

    for wrap in (lambda s: s, ProtocolStream):
        stream = torch.cuda.Stream()
        src = torch.from_numpy(rng.integers(0, 256, 4096, dtype=np.uint8)).pin_memory()
        dst = torch.full((4096,), POISON, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        result = kv.batch_copy([src.data_ptr()], [dst.data_ptr()], [4096], stream=wrap(stream),
                               registry=kv.UNCHECKED)
        stream.synchronize()
        assert result.path == "batch" and torch.equal(dst.cpu(), src)

