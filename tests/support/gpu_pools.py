"""What the SM-assisted copies' GPU tests share: pinned host and device pools, a
scattered copy between them checked byte for byte, and refused memory left untouched."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from scatter import POISON, scatter

POOL = 8 << 20
DIRECTIONS = {"load": ("host", "device"), "store": ("device", "host"), "d2d": ("device", "device")}


def pool(where, data):
    host = torch.from_numpy(data)
    return host.pin_memory() if where == "host" else host.cuda()


def run(copy, rng, way, sizes, slot, misalign, pool_bytes=POOL, **kwargs):
    src_where, dst_where = DIRECTIONS[way]
    src_bytes = rng.integers(0, 256, pool_bytes, dtype=np.uint8)
    src, dst = pool(src_where, src_bytes), pool(dst_where, np.full(pool_bytes, POISON, np.uint8))
    plan = scatter(rng, sizes, slot=slot, pool_bytes=pool_bytes, misalign=misalign)
    registry = kv.MemoryRegistry()
    registry.register_tensor("src", src)
    registry.register_tensor("dst", dst)
    stream = torch.cuda.Stream()
    s, d = plan.pointers(src.data_ptr(), dst.data_ptr())
    torch.cuda.synchronize()
    result = copy(s, d, plan.sizes, stream=stream, registry=registry, **kwargs)
    stream.synchronize()
    np.testing.assert_array_equal(dst.cpu().numpy(), plan.expected(src_bytes, np.full(pool_bytes, POISON, np.uint8)))
    return result


def memory(kind, fill):
    t = torch.full((1 << 20,), fill, dtype=torch.uint8)
    return {"device": t.cuda, "pinned": t.pin_memory, "pageable": lambda: t}[kind]()


def check_refused(copy, src_kind, dst_kind, message):
    """`copy` between memory of these kinds raises a ValueError matching `message` and
    leaves the destination as it was."""
    src, dst = memory(src_kind, 7), memory(dst_kind, POISON)
    offsets = np.arange(16, dtype=np.int64) * 4096
    with pytest.raises(ValueError, match=message):
        copy(offsets + src.data_ptr(), offsets + dst.data_ptr(), np.full(16, 4096), stream=torch.cuda.Stream(),
             registry=kv.UNCHECKED)
    torch.cuda.synchronize()
    assert (dst.cpu() == POISON).all()


def check_stream_order(copy, value):
    """``copy(src, dst, sizes, stream=...)`` queued after a kernel that writes its device
    source must see the written values in the host destination."""
    src = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    host = torch.full((1 << 20,), POISON, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000)
        src.fill_(value)
    offsets = np.arange(256, dtype=np.int64) * 4096
    copy(offsets + src.data_ptr(), offsets + host.data_ptr(), np.full(256, 4096), stream=stream)
    stream.synchronize()
    assert (host == value).all()
