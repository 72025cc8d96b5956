"""Multi-group layouts and transfers (kvoffload.pages.planner) as the handler plans them: the
page table's copies (pages.table.transfer_plan), checked byte for byte through the host
copy path, against the per-block reference, and on bad input."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvoffload as kv
from kvoffload.pages.table import job_arguments, page_table, transfer_plan
from kvoffload.pages.planner import (CPUSpec, GPUSpec, GroupLayout, KVLayout, TensorLayout,
                               check_shared, chunks_used)
from kv_model import POISON, KVModel
from layouts import transfers
from planner_reference import job_blocks, plan_per_block


def plan(layout, gpu, cpu, host_breaks=(), direction=kv.Direction.STORE):
    """The handler's order: the table checks the ids, then the groups sharing tensors."""
    table = page_table(layout, host_breaks)
    job = table.prepare(*job_arguments(gpu, cpu))
    check_shared(layout, gpu, cpu)
    return transfer_plan(table, job, direction)


def chunk_major(group, bpc):
    """Whether the page table takes ``group``'s pool as chunk-major: each tensor's pages
    of a chunk right after the previous tensor's, at one stride."""
    if not group.tensors:
        return True
    first, offset = group.tensors[0], 0
    for t in group.tensors:
        if t.cpu_stride != first.cpu_stride or t.cpu_base != first.cpu_base + offset:
            return False
        offset += bpc * t.page_bytes
    return True


def merged_per_block(layout, gpu, cpu, host_breaks=(), direction=kv.Direction.STORE):
    """The per-block reference, each tensor's chunks taken in the page table's DMA order
    (by the GPU block id of their first page, or by chunk for a store from a tensor-major
    pool), consecutive pages of one tensor merged where they continue on both sides and no
    host break lies between: the plan's copies, sorted."""
    pages, at, merged = plan_per_block(layout, gpu, cpu), 0, []
    blocks = list(job_blocks(layout.blocks_per_chunk, gpu.block_ids, gpu.group_sizes, gpu.block_indices,
                             cpu.chunk_ids))
    for g, group in enumerate(layout.groups):
        mine = [b for b in blocks if b[0] == g]  # (group, block, chunk, sub-block) in job order
        runs = [list(run) for _, run in itertools.groupby(range(len(mine)), key=lambda i: mine[i][2])]
        by_chunk = direction is kv.Direction.STORE and not chunk_major(group, layout.blocks_per_chunk)
        place = (lambda run: mine[run[0]][2]) if by_chunk else (lambda run: mine[run[0]][1])
        order = [i for run in sorted(runs, key=place) for i in run]
        for _ in group.tensors:  # the reference is tensor-major in each group
            last = None
            for i in order:
                a, c, n = pages[at + i]
                if last and last[0] + last[2] == a and last[1] + last[2] == c and c not in host_breaks:
                    last[2] += n
                else:
                    last = [a, c, n]
                    merged.append(last)
            at += len(mine)
    return sorted(map(tuple, merged))


def copies(planned):
    return list(zip(planned.gpu.tolist(), planned.cpu.tolist(), planned.sizes.tolist()))


# ---- a KV cache of CPU tensors standing in for the GPU, and its CPU pool ----

class Cache:
    """gpu[g][t]: [num_blocks, page] random bytes; cpu[g][t]: [num_chunks, bpc * page], poisoned;
    model: what both must hold."""

    def __init__(self, rng, pages, tensors, num_blocks, num_chunks, bpc):
        self.gpu = [[torch.from_numpy(rng.integers(0, 256, (num_blocks, p), dtype=np.uint8))
                     for _ in range(n)] for p, n in zip(pages, tensors)]
        self.cpu = [[torch.full((num_chunks, bpc * p), POISON, dtype=torch.uint8)
                     for _ in range(n)] for p, n in zip(pages, tensors)]
        self.layout = KVLayout.from_tensors(self.gpu, self.cpu, bpc)
        self.model = KVModel([[t.numpy() for t in g] for g in self.gpu], [num_chunks] * len(pages), bpc)

    def check(self):
        for g, (gpu, cpu) in enumerate(zip(self.gpu, self.cpu)):
            for t, (a, b) in enumerate(zip(gpu, cpu)):
                np.testing.assert_array_equal(a.numpy(), self.model.gpu[g][t], f"gpu group {g} tensor {t}")
                np.testing.assert_array_equal(b.numpy().reshape(self.model.cpu[g][t].shape),
                                              self.model.cpu[g][t], f"cpu group {g} tensor {t}")


def run(cache, direction, block_ids, group_sizes, block_indices, chunk_ids):
    planned = plan(cache.layout, GPUSpec(block_ids, group_sizes, block_indices), CPUSpec(chunk_ids))
    result = kv.host_copy(*(planned.store() if direction == "store" else planned.load()), registry=kv.UNCHECKED)
    assert result.bytes == planned.total_bytes
    getattr(cache.model, direction)(block_ids, group_sizes, block_indices, chunk_ids)
    cache.check()
    return planned


# ---- vLLM's offload worker cases ----

@pytest.mark.parametrize("page", [512, 1024])
@pytest.mark.parametrize("bpc", [1, 3])
def test_store_then_load_skipping_the_first_blocks_of_a_chunk(page, bpc):
    rng = np.random.default_rng(page + bpc)
    cache = Cache(rng, [page], [4], num_blocks=16, num_chunks=12, bpc=bpc)
    stored = rng.permutation(16)[:7]
    chunks = rng.permutation(12)[: chunks_used(7, 0, bpc)]
    assert run(cache, "store", stored, [7], [0], chunks).total_bytes == 7 * 4 * page
    # Load back blocks 1.. of the stored run: the first sub-block of the first chunk is skipped.
    for first in range(1, 3):
        n = 7 - first
        targets = rng.permutation(16)[:n]
        used = chunks_used(n, first, bpc)
        load_chunks = chunks[first // bpc : first // bpc + used]
        assert run(cache, "load", targets, [n], [first], load_chunks).total_bytes == n * 4 * page


def test_three_groups_aligned_empty_and_unaligned_at_both_ends():
    rng = np.random.default_rng(7)
    bpc = 4
    cache = Cache(rng, pages=[256, 512, 768], tensors=[2, 2, 2], num_blocks=20, num_chunks=10, bpc=bpc)
    # group 0: 8 blocks from index 0 (2 whole chunks); group 1: nothing;
    # group 2: 6 blocks from index 3 (starts at sub-block 3, ends at sub-block 0: 3 chunks).
    sizes, firsts = [8, 0, 6], [0, 5, 3]
    block_ids = np.concatenate([rng.permutation(20)[:8], rng.permutation(20)[:6]])
    chunk_ids = np.concatenate([rng.permutation(10)[:2], rng.permutation(10)[:3]])
    assert run(cache, "store", block_ids, sizes, firsts, chunk_ids).total_bytes == 8 * 2 * 256 + 6 * 2 * 768
    assert [chunks_used(n, b, bpc) for n, b in zip(sizes, firsts)] == [2, 0, 3]
    load_ids = np.concatenate([rng.permutation(20)[:8], rng.permutation(20)[:6]])
    run(cache, "load", load_ids, sizes, firsts, chunk_ids)


@pytest.mark.parametrize("direction", list(kv.Direction))
def test_a_tensor_major_pool_goes_tensor_by_tensor_in_the_order_of_where_copies_land(direction):
    rng = np.random.default_rng(11)
    page, blocks, tensors = 64, 40, 3
    # Padded on both sides: no two pages merge, so each copy is one page.
    layout = KVLayout((GroupLayout(tuple(TensorLayout((1 << 20) + t * (1 << 16), page + 8, page,
                                                      (1 << 30) + t * (1 << 16), page + 16)
                                         for t in range(tensors)), blocks, blocks),), 1)
    ids, chunks = rng.permutation(blocks)[:30], rng.permutation(blocks)[:30]
    planned = plan(layout, GPUSpec(ids, [30], [0]), CPUSpec(chunks), direction=direction)
    gpu, host = planned.gpu.reshape(tensors, 30), planned.cpu.reshape(tensors, 30)
    assert (np.diff(gpu[:, 0]) > 0).all() and (np.diff(host[:, 0]) > 0).all()  # tensor by tensor
    landing = host if direction is kv.Direction.STORE else gpu
    assert (np.diff(landing, axis=1) > 0).all()
    assert sorted(zip(gpu[0].tolist(), host[0].tolist())) == sorted(
        zip(((1 << 20) + ids * (page + 8)).tolist(), ((1 << 30) + chunks * (page + 16)).tolist()))
    table = page_table(layout)
    job = table.prepare(*job_arguments(GPUSpec(ids, [30], [0]), CPUSpec(chunks)))
    assert np.array_equal(transfer_plan(table, job, direction.value).cpu, planned.cpu)
    with pytest.raises(ValueError, match="direction: expected one of"):
        transfer_plan(table, job, "sideways")


def test_consecutive_pages_of_a_tensor_merge_into_whole_chunks():
    rng = np.random.default_rng(3)
    cache = Cache(rng, [256], [3], num_blocks=32, num_chunks=8, bpc=4)
    gpu, cpu = GPUSpec(np.arange(8, 16), [8], [0]), CPUSpec([2, 3])
    # Each tensor: GPU blocks 8..15 are contiguous and so are chunks 2..3.
    assert len(plan_per_block(cache.layout, gpu, cpu)) == 24
    assert run(cache, "store", gpu.block_ids, [8], [0], cpu.chunk_ids).descriptors == 3
    assert run(cache, "store", gpu.block_ids, [8], [0], np.array([5, 1])).descriptors == 6  # a run per chunk and tensor


def test_padded_gpu_blocks_do_not_merge_on_the_gpu_side():
    gpu = [[torch.zeros((8, 2, 128), dtype=torch.uint8)]]
    cpu = [[torch.zeros((4, 2 * 128), dtype=torch.uint8)]]
    layout = KVLayout.from_tensors(gpu, cpu, blocks_per_chunk=2, page_bytes=[128])
    planned = plan(layout, GPUSpec(np.arange(4), [4], [0]), CPUSpec([0, 1]))
    assert planned.descriptors == 4 and set(planned.sizes) == {128}


def adjacent_tensors(chunk_major):
    """One group of two 64-byte-page tensors, the second starting where the first ends on
    the GPU (4 blocks) and on the CPU (one chunk of 4 blocks), or interleaved in the chunk."""
    if chunk_major:
        cpu = [(1 << 30, 512), ((1 << 30) + 256, 512)]
    else:
        cpu = [(1 << 30, 256), ((1 << 30) + 256, 256)]
    return KVLayout((GroupLayout(tuple(TensorLayout((1 << 20) + t * 256, 64, 64, *cpu[t]) for t in range(2)),
                                 4, 1),), 4)


@pytest.mark.parametrize("chunk_major", [False, True])
def test_pages_of_two_tensors_never_merge_even_where_they_continue(chunk_major):
    layout = adjacent_tensors(chunk_major)
    gpu, cpu = GPUSpec(np.arange(4), [4], [0]), CPUSpec([0])
    planned = plan(layout, gpu, cpu)
    assert copies(planned) == [(1 << 20, 1 << 30, 256), ((1 << 20) + 256, (1 << 30) + 256, 256)]
    # A host break splits one tensor's run, on the page it falls on.
    planned = plan(layout, gpu, cpu, host_breaks=[(1 << 30) + 128])
    assert copies(planned) == [(1 << 20, 1 << 30, 128), ((1 << 20) + 128, (1 << 30) + 128, 128),
                               ((1 << 20) + 256, (1 << 30) + 256, 256)]


# ---- property tests against the per-block reference ----

@settings(max_examples=300, deadline=None)
@given(transfers(), st.data(), st.sampled_from(list(kv.Direction)))
def test_matches_the_per_block_reference(transfer, data, direction):
    layout, gpu, cpu = transfer
    reference = plan_per_block(layout, gpu, cpu)
    starts = sorted({c for _, c, _ in reference})
    breaks = data.draw(st.lists(st.sampled_from(starts), unique=True) if starts else st.just([]))
    planned = plan(layout, gpu, cpu, breaks, direction)
    assert sorted(copies(planned)) == merged_per_block(layout, gpu, cpu, breaks, direction)
    assert planned.total_bytes == sum(n for _, _, n in reference)
    assert len(reference) >= planned.descriptors
    for array in (planned.gpu, planned.cpu, planned.sizes):
        assert array.dtype == np.int64 and array.flags.c_contiguous


@settings(max_examples=60, deadline=None)
@given(transfers(), st.sampled_from(["store", "load"]))
def test_the_plan_writes_the_same_bytes_as_the_per_block_reference(transfer, direction):
    layout, gpu, cpu = transfer
    reference = np.array(plan_per_block(layout, gpu, cpu), dtype=np.int64).reshape(-1, 3).T.copy()
    planned = plan(layout, gpu, cpu, direction=kv.Direction(direction))
    # Back the layout's address ranges with real memory: GPU side at 1 MiB, CPU side at 1 GiB.
    rng = np.random.default_rng(0)
    start = rng.integers(0, 256, 1 << 16, dtype=np.uint8), rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    images = []
    for gpu_at, cpu_at, sizes in (reference, (planned.gpu, planned.cpu, planned.sizes)):
        gpu_mem, cpu_mem = start[0].copy(), start[1].copy()
        src, dst = gpu_at + gpu_mem.ctypes.data - (1 << 20), cpu_at + cpu_mem.ctypes.data - (1 << 30)
        if direction == "load":
            src, dst = dst, src
        if len(sizes):
            kv.host_copy(src, dst, sizes, registry=kv.UNCHECKED)
        images.append((gpu_mem, cpu_mem))
    np.testing.assert_array_equal(images[0][0], images[1][0])
    np.testing.assert_array_equal(images[0][1], images[1][1])


# ---- bad input ----

def small_layout(bpc=2):
    return KVLayout((GroupLayout((TensorLayout(1 << 20, 64, 64, 1 << 30, 128),), 10, 5),
                     GroupLayout((TensorLayout(2 << 20, 32, 32, 2 << 30, 64),), 8, 4)), bpc)


BAD_PLANS = {
    "block id too large": (([1, 2, 10, 0], [3, 1], [0, 0]), [0, 1, 0], r"group 0: block_ids\[2\] = 10 is out of range \[0, 10\)"),
    "negative block id": (([1, 2, 3, -1], [3, 1], [0, 0]), [0, 1, 0], r"group 1: block_ids\[3\] = -1 is out of range \[0, 8\)"),
    "chunk id too large": (([1, 2, 3, 0], [3, 1], [0, 0]), [0, 1, 4], r"group 1: chunk_ids\[2\] = 4 is out of range \[0, 4\)"),
    "negative chunk id": (([1, 2, 3, 0], [3, 1], [0, 0]), [-2, 1, 0], r"group 0: chunk_ids\[0\] = -2 is out of range"),
    "block twice": (([1, 2, 1, 0], [3, 1], [0, 0]), [0, 1, 0], r"group 0: block_ids\[2\] = 1 appears twice"),
    "chunk twice": (([1, 2, 3, 0], [3, 1], [0, 0]), [3, 3, 0], r"group 0: chunk_ids\[1\] = 3 appears twice"),
    "too many chunks": (([1, 2, 3, 0], [3, 1], [0, 0]), [0, 1, 0, 2], r"^chunk_ids: has 4 ids but the groups use 3 chunks \(2, 1\)$"),
    "too few chunks": (([1, 2, 3, 0], [3, 1], [0, 0]), [0, 1], r"^chunk_ids: has 2 ids but the groups use 3 chunks \(2, 1\)$"),
    "group count": (([1, 2, 3], [3], [0]), [0, 1], r"group_sizes: has 1 groups but the layout has 2"),
}


@pytest.mark.parametrize("case", BAD_PLANS.keys())
def test_bad_plans_name_the_group_and_index(case):
    (ids, sizes, firsts), chunks, message = BAD_PLANS[case]
    with pytest.raises(ValueError, match=message):
        plan(small_layout(), GPUSpec(ids, sizes, firsts), CPUSpec(chunks))


BAD_SPECS = {
    "sizes disagree": (lambda: GPUSpec([1, 2, 3], [2, 2], [0, 0]), ValueError, r"group_sizes: add up to 4 but block_ids has 3"),
    "indices length": (lambda: GPUSpec([1, 2], [1, 1], [0]), ValueError, r"block_indices: has 1 entries but group_sizes has 2"),
    "negative size": (lambda: GPUSpec([1], [-1, 2], [0, 0]), ValueError, r"group_sizes\[0\]: must be >= 0"),
    "negative index": (lambda: GPUSpec([1], [1], [-3]), ValueError, r"block_indices\[0\]: must be >= 0"),
    "float ids": (lambda: GPUSpec([1.0, 2.0], [2], [0]), TypeError, r"block_ids: expected dtype int64"),
    "2-D chunks": (lambda: CPUSpec([[1, 2]]), ValueError, r"chunk_ids: expected a 1-D array"),
    "bool size": (lambda: GPUSpec([1], [True], [0]), TypeError, r"group_sizes\[0\]: expected an int"),
    "None ids": (lambda: GPUSpec(None, [0], [0]), TypeError, r"block_ids: expected a 1-D int64 array or a sequence of ints, got NoneType"),
    "2-D chunk array": (lambda: CPUSpec(np.arange(4)[::2].reshape(1, 2)), ValueError, r"chunk_ids: expected a 1-D array, got 2-D"),
    "page over stride": (lambda: TensorLayout(1, 32, 64, 1, 64), ValueError, r"gpu_stride: must be >= 64"),
    "null base": (lambda: TensorLayout(0, 64, 64, 1, 64), ValueError, r"gpu_base: must be >= 1"),
    "chunk too small": (lambda: KVLayout((GroupLayout((TensorLayout(1, 64, 64, 1, 64),), 1, 1),), 2),
                        ValueError, r"group 0 tensor 0: cpu_stride 64 cannot hold 2 pages of 64 bytes"),
    "overlap on gpu": (lambda: KVLayout((GroupLayout((TensorLayout(1000, 64, 64, 1 << 20, 64),
                                                      TensorLayout(1064, 64, 64, 2 << 20, 64)), 4, 4),), 1),
                       ValueError, r"group 0 tensor 0 and group 0 tensor 1 overlap on the GPU side"),
    "overlap on cpu": (lambda: KVLayout((GroupLayout((TensorLayout(1 << 20, 64, 64, 5000, 128),), 4, 4),
                                         GroupLayout((TensorLayout(2 << 20, 64, 64, 5100, 128),), 4, 4)), 1),
                       ValueError, r"group 0 tensor 0 and group 1 tensor 0 overlap on the CPU side"),
}


@pytest.mark.parametrize("case", BAD_SPECS.keys())
def test_bad_specs_and_layouts(case):
    make, error, message = BAD_SPECS[case]
    with pytest.raises(error, match=message):
        make()


def test_ids_of_any_integer_array_are_copied_as_int64():
    rng = np.random.default_rng(8)
    ids = rng.permutation(1000)[:40]
    for given in (ids.astype(np.int32), ids.astype(np.uint16), ids[::-1][::-1], ids.tolist(), torch.from_numpy(ids)):
        spec = CPUSpec(given)
        assert spec.chunk_ids.dtype == np.int64 and spec.chunk_ids.flags.c_contiguous
        np.testing.assert_array_equal(spec.chunk_ids, ids)
    mine = ids.copy()
    spec = GPUSpec(mine, [40], [0])
    mine[:] = -1  # the spec holds its own copy
    np.testing.assert_array_equal(spec.block_ids, ids)
    # A masked array's masked entries would come through as ids: refused by name.
    masked = np.ma.masked_array(ids, mask=rng.random(40) < 0.5)
    with pytest.raises(TypeError, match=r"block_ids: a masked array's masked entries are no ids"):
        GPUSpec(masked, [40], [0])
    with pytest.raises(TypeError, match=r"chunk_ids: a masked array"):
        CPUSpec(masked)


def test_interleaved_tensors_are_not_an_overlap():
    # K and V of a block side by side ([num_blocks, 2, page]): interleaved, never sharing a byte.
    KVLayout((GroupLayout((TensorLayout(1000, 128, 64, 1 << 20, 64),
                           TensorLayout(1064, 128, 64, 2 << 20, 64)), 4, 4),), 1)


def shared_layout():
    """Two groups referencing one GPU tensor and one CPU region, with 64- and 32-byte pages
    inside a 64-byte row, and a third group of its own."""
    shared = lambda page: TensorLayout(1000, 64, page, 1 << 20, 128)
    return KVLayout((GroupLayout((shared(64),), 8, 4), GroupLayout((shared(32),), 8, 4),
                     GroupLayout((TensorLayout(9000, 64, 64, 2 << 20, 128),), 8, 4)), 2)


def test_groups_may_share_a_tensor_each_with_its_page():
    layout = shared_layout()
    assert layout.gpu_alias == layout.cpu_alias == (0, 0, 2)
    planned = plan(layout, GPUSpec([1, 2, 3], [1, 1, 1], [0, 0, 0]), CPUSpec([0, 1, 0]))
    assert copies(planned) == [(1064, 1 << 20, 64), (1128, (1 << 20) + 128, 32), (9192, 2 << 20, 64)]


@pytest.mark.parametrize("gpu, cpu, message", [
    (GPUSpec([5, 5, 5], [1, 1, 1], [0, 0, 0]), CPUSpec([0, 1, 2]),
     r"group 1: block_ids\[1\] = 5 is also used by group 0 \(block_ids\[0\]\), which shares its GPU"),
    (GPUSpec([1, 2, 3], [1, 1, 1], [0, 0, 0]), CPUSpec([3, 3, 3]),
     r"group 1: chunk_ids\[1\] = 3 is also used by group 0 \(chunk_ids\[0\]\), which shares its CPU"),
])
def test_a_transfer_naming_a_shared_block_twice_is_refused(gpu, cpu, message):
    with pytest.raises(ValueError, match=message):
        plan(shared_layout(), gpu, cpu)


def test_a_partly_shared_tensor_is_still_an_overlap():
    with pytest.raises(ValueError, match=r"group 0 tensor 0 and group 1 tensor 0 overlap on the GPU"):
        KVLayout((GroupLayout((TensorLayout(1000, 64, 64, 1 << 20, 64),), 8, 4),
                  GroupLayout((TensorLayout(1000, 128, 64, 2 << 20, 64),), 4, 4)), 1)
    with pytest.raises(ValueError, match=r"group 0 tensor 0 and group 0 tensor 1 overlap on the GPU"):
        KVLayout((GroupLayout((TensorLayout(1000, 64, 64, 1 << 20, 64),
                               TensorLayout(1000, 64, 64, 2 << 20, 64)), 8, 4),), 1)


def test_from_tensors_rejects_mismatched_groups():
    gpu = [[torch.zeros((8, 64), dtype=torch.uint8), torch.zeros((6, 64), dtype=torch.uint8)]]
    cpu = [[torch.zeros((4, 64), dtype=torch.uint8), torch.zeros((4, 64), dtype=torch.uint8)]]
    with pytest.raises(ValueError, match=r"gpu\[0\]: tensors of one group differ in block count"):
        KVLayout.from_tensors(gpu, cpu, 1)
    gpu = [[torch.zeros((8, 64), dtype=torch.uint8), torch.zeros((8, 64), dtype=torch.uint8)]]
    cpu = [[torch.zeros((4, 64), dtype=torch.uint8), torch.zeros((5, 64), dtype=torch.uint8)]]
    with pytest.raises(ValueError, match=r"cpu\[0\]: tensors of one group differ in chunk count"):
        KVLayout.from_tensors(gpu, cpu, 1)
    with pytest.raises(ValueError, match=r"gpu\[0\]\[0\]: each block \(dims 1 and up\) must be contiguous"):
        KVLayout.from_tensors([[torch.zeros((8, 64, 2))[:, :, 0]]], [[torch.zeros((4, 512))]], 1)
    with pytest.raises(ValueError, match=r"cpu\[0\]\[0\]: a chunk cannot hold 2 pages of 256 bytes"):
        KVLayout.from_tensors([[torch.zeros((8, 64))]], [[torch.zeros((4, 64))]], 2)
    with pytest.raises(ValueError, match=r"cpu: has 0 groups but gpu has 1"):
        KVLayout.from_tensors([[torch.zeros((8, 64))]], [], 2)


def test_a_failed_plan_copies_nothing_because_nothing_is_returned():
    rng = np.random.default_rng(5)
    cache = Cache(rng, [128], [2], num_blocks=8, num_chunks=4, bpc=2)
    with pytest.raises(ValueError):
        plan(cache.layout, GPUSpec([0, 1, 8], [3], [0]), CPUSpec([0, 1]))
    cache.check()


def test_extents_past_2_63_are_refused_before_the_overlap_check():
    rng = np.random.default_rng(7)
    for _ in range(20):
        page = int(rng.integers(1, 1 << 12))
        blocks = int(rng.integers(3, 64))
        stride = int(rng.integers(2**62, 2**63 - 1))  # (blocks - 1) * stride wraps int64
        base = int(rng.integers(1, 1 << 40))
        wrapping = TensorLayout(base, stride, page, 1 << 20, page)
        # A second tensor inside the wrapped-around range: int64 arithmetic would see no overlap.
        hidden = TensorLayout(base + stride, page, page, 2 << 20, page)
        for tensors in ((wrapping,), (wrapping, hidden)):
            with pytest.raises(ValueError, match=r"group 0 tensor 0: its GPU extent ends past 2\^63"):
                KVLayout((GroupLayout(tensors, blocks, 1),), 1)
        cpu = TensorLayout(base, page, page, base, stride)
        with pytest.raises(ValueError, match=r"group 0 tensor 0: its CPU extent ends past 2\^63"):
            KVLayout((GroupLayout((cpu,), 1, blocks),), 1)


def test_specs_are_values():
    ids = np.array([4, 1, 7], dtype=np.int64)
    a, b = GPUSpec(ids, [2, 1], [0, 3]), GPUSpec([4, 1, 7], (2, 1), (0, 3))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != GPUSpec([4, 1, 7], [1, 2], [0, 3]) and a != GPUSpec([4, 1, 8], [2, 1], [0, 3])
    assert a != GPUSpec([4, 1, 7], [2, 1], [0, 4]) and a != "spec"
    ids[0] = 9  # the caller's array is not the spec's
    assert a == b
    with pytest.raises(ValueError, match="read-only"):
        a.block_ids[0] = 5
    c, d = CPUSpec([3, 0]), CPUSpec(np.array([3, 0], dtype=np.int32))
    assert c == d and hash(c) == hash(d) and c != CPUSpec([0, 3]) and c != a
    with pytest.raises(ValueError, match="read-only"):
        c.chunk_ids[0] = 1
