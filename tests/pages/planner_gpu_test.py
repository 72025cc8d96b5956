"""A multi-group store and load round trip on a GPU: the page table's plan, ordering and
batch copy."""

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload.copy.ordering import MemoryKind, PendingWrites, safe_order
from kvoffload.pages.planner import CPUSpec, GPUSpec, KVLayout, chunks_used
from kvoffload.pages.table import job_arguments, page_table, transfer_plan


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


@pytest.mark.parametrize("bpc", [1, 3, 16])
def test_multi_group_round_trip(bpc):
    rng = np.random.default_rng(bpc)
    # Two groups with different page sizes (e.g. full and sliding-window attention),
    # blocks padded on the GPU (page < stride) in group 1, plus an empty group.
    shapes = [(64, 16, 8, 128), (48, 16, 4, 128), (32, 16, 8, 64)]
    gpu = [[torch.randint(-1000, 1000, s, dtype=torch.int16, device="cuda") for _ in range(4)]
           for s in shapes]
    pages = [16 * 8 * 128 * 2, 16 * 4 * 96 * 2, 16 * 8 * 64 * 2]
    num_chunks = [40, 40, 40]
    cpu = [[torch.full((c, bpc * p), 0xA5, dtype=torch.uint8).pin_memory() for _ in range(4)]
           for c, p in zip(num_chunks, pages)]
    layout = KVLayout.from_tensors(gpu, cpu, bpc, page_bytes=pages)

    sizes, firsts = [20, 13, 0], [0, 2 * bpc - 1, 4]
    block_ids = np.concatenate([rng.permutation(64)[:20], rng.permutation(48)[:13]])
    chunk_ids = np.concatenate([rng.permutation(40)[: chunks_used(n, b, bpc)] for n, b in zip(sizes, firsts)])
    table = page_table(layout)
    plan = transfer_plan(table, table.prepare(*job_arguments(GPUSpec(block_ids, sizes, firsts),
                                                             CPUSpec(chunk_ids))), kv.Direction.STORE)
    assert plan.total_bytes == 4 * (20 * pages[0] + 13 * pages[1])

    original = [[t.clone() for t in g] for g in gpu]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    store = kv.batch_copy(*plan.store(), stream=stream,
                          order=safe_order(MemoryKind.DEVICE, MemoryKind.HOST, PendingWrites.UNKNOWN), registry=kv.UNCHECKED)
    stream.synchronize()
    for g in gpu:
        for t in g:
            t.fill_(0)
    torch.cuda.synchronize()
    load = kv.batch_copy(*plan.load(), stream=stream,
                         order=safe_order(MemoryKind.HOST, MemoryKind.DEVICE, PendingWrites.NO), registry=kv.UNCHECKED)
    stream.synchronize()
    assert store.path == load.path == "batch"

    offset = 0
    for g, n in enumerate(sizes):
        ids = torch.from_numpy(block_ids[offset : offset + n]).cuda()
        offset += n
        page_elems = pages[g] // 2
        for t in range(4):
            got = gpu[g][t].view(shapes[g][0], -1)
            want = original[g][t].view(shapes[g][0], -1)
            assert torch.equal(got[ids, :page_elems], want[ids, :page_elems])
            others = torch.ones(shapes[g][0], dtype=torch.bool, device="cuda")
            others[ids] = False
            assert (got[others] == 0).all() and (got[ids, page_elems:] == 0).all()
