"""kvoffload.pages.table without a GPU: the units a job's kernels copy are the per-block
reference's pages, and bad ids and layouts are refused before anything is enqueued."""

import numpy as np
import pytest
from hypothesis import given, settings

from kvoffload import _C
from kvoffload.pages.planner import GroupLayout, KVLayout, TensorLayout
from kvoffload.pages.table import UNIT_BYTES, ChunkParts, job_arguments, key_offsets, page_table
from layouts import transfers
from planner_reference import plan_per_block

LOAD, STORE = _C.Direction.LOAD, _C.Direction.STORE


def as_units(gpu, cpu, sizes):
    """Descriptors cut into units, sorted: the same bytes compare equal however cut."""
    rows = [(g + o, c + o, min(UNIT_BYTES, n - o))
            for g, c, n in zip(gpu.tolist(), cpu.tolist(), sizes.tolist())
            for o in range(0, n, UNIT_BYTES)]
    return sorted(rows)


@settings(max_examples=300, deadline=None)
@given(transfers())
def test_units_are_the_per_block_references_pages(transfer):
    layout, gpu, cpu = transfer
    reference = np.array(plan_per_block(layout, gpu, cpu), dtype=np.int64).reshape(-1, 3).T
    units = page_table(layout).unit_copies(*job_arguments(gpu, cpu))
    assert all(u.dtype == np.int64 for u in units)
    assert as_units(*units) == as_units(*reference)


@settings(max_examples=200, deadline=None)
@given(transfers())
def test_spans_end_at_each_tensors_last_block_and_chunk_and_hold_every_page(transfer):
    layout, gpu, cpu = transfer
    gpu_spans, cpu_spans = page_table(layout).spans()
    tensors = [(group, t) for group in layout.groups for t in group.tensors]
    assert len(gpu_spans) == len(cpu_spans) == len(tensors)
    for (group, t), gpu_span, cpu_span in zip(tensors, gpu_spans.tolist(), cpu_spans.tolist()):
        n, c = group.num_gpu_blocks, group.num_cpu_chunks
        assert gpu_span == ((n - 1) * t.gpu_stride + t.page_bytes if n else 0)
        assert cpu_span == ((c - 1) * t.cpu_stride + layout.blocks_per_chunk * t.page_bytes if c else 0)
    for g, h, n in plan_per_block(layout, gpu, cpu):
        assert any(t.gpu_base <= g and g + n <= t.gpu_base + gs and t.cpu_base <= h and h + n <= t.cpu_base + cs
                   for (_, t), gs, cs in zip(tensors, gpu_spans.tolist(), cpu_spans.tolist()))


def test_pages_larger_than_a_unit_are_cut_into_units():
    page = 2 * UNIT_BYTES + 48
    layout = KVLayout((GroupLayout((TensorLayout(1 << 30, page, page, 1 << 40, 2 * page),), 4, 3),), 2)
    units = page_table(layout).unit_copies([3, 1], [2], [2], [0])
    assert units[2].tolist() == [UNIT_BYTES, UNIT_BYTES, 48] * 2
    assert units[0].tolist()[:3] == [(1 << 30) + 3 * page + k * UNIT_BYTES for k in range(3)]
    assert units[1].tolist()[3] == (1 << 40) + 2 * 2 * page + page


def small_table():
    """Two groups of one tensor: 8 blocks of 64 bytes, 4 chunks of two pages each."""
    groups = tuple(GroupLayout((TensorLayout(k << 30, 64, 64, k << 40, 128),), 8, 4) for k in (1, 2))
    return page_table(KVLayout(groups, 2))


BAD_JOBS = {
    "block out of range": (([0, 8], [0, 1], [1, 1], [0, 0]), r"group 1: block_ids\[1\] = 8 is out of range \[0, 8\)"),
    "negative chunk": (([0, 1], [-1, 1], [1, 1], [0, 0]), r"group 0: chunk_ids\[0\] = -1 is out of range"),
    "repeated block": (([2, 2, 5], [0, 1], [2, 1], [0, 0]), r"group 0: block_ids\[1\] = 2 appears twice"),
    "chunk count": (([0, 1], [0], [1, 1], [0, 0]), r"chunk_ids: has 1 ids but the groups use 2"),
    "group count": (([0], [0], [1], [0]), r"group_sizes: has 1 groups but the layout has 2"),
    "sizes vs ids": (([0, 1, 2], [0, 1], [1, 1], [0, 0]), r"group_sizes: add up to 2 but block_ids has 3"),
    "negative first": (([0, 1], [0, 1], [1, 1], [0, -2]), r"block_indices\[1\]: must be >= 0"),
    "indices length": (([0, 1], [0, 1], [1, 1], [0]), r"block_indices: has 1 entries but group_sizes has 2"),
}


@pytest.mark.parametrize("case", BAD_JOBS)
def test_bad_jobs_name_the_group_and_index(case):
    args, message = BAD_JOBS[case]
    table = small_table()
    with pytest.raises(ValueError, match=message):
        table.check(*args)
    with pytest.raises(ValueError, match=message):
        table.unit_copies(*args)
    with pytest.raises(ValueError, match=message):
        table.prepare(*args)
    table.check([0, 1], [0, 1], [1, 1], [0, 0])  # the table is still usable


def test_keys_number_a_prepared_jobs_blocks_and_sub_blocks():
    rng = np.random.default_rng(3)
    table, other = small_table(), small_table()
    blocks = np.concatenate([rng.permutation(8)[:3], rng.permutation(8)[:2]])
    chunks = np.concatenate([rng.permutation(4)[:2], rng.permutation(4)[:2]])
    job = table.prepare(blocks, chunks, [3, 2], [1, 3])
    blocks[:] = -1  # the job holds its own copy of the ids
    gpu, cpu = table.keys(job, np.array([100, 200]), np.array([1000, 2000]))
    assert gpu.tolist() == (np.array([100] * 3 + [200] * 2) + job.ids()[0]).tolist()
    # Group 0's blocks are logical indices 1..3 (sub-blocks 1 and 0, 1 of its chunks),
    # group 1's 3..4 (sub-block 1 of its first chunk, then 0 of its second).
    want = [1000 + 2 * chunks[0] + 1, 1000 + 2 * chunks[1], 1000 + 2 * chunks[1] + 1,
            2000 + 2 * chunks[2] + 1, 2000 + 2 * chunks[3]]
    assert cpu.tolist() == want
    with pytest.raises(ValueError, match="^job: was prepared by another PageTable$"):
        other.keys(job, np.zeros(2, np.int64), np.zeros(2, np.int64))


def test_bad_id_arrays_are_type_errors():
    table = small_table()
    with pytest.raises(TypeError, match="block_ids: expected dtype int64"):
        table.check(np.array([0, 1], np.int32), [0, 1], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="chunk_ids: expected a 1-D array"):
        table.check([0, 1], np.zeros((1, 2), np.int64), [1, 1], [0, 0])


def raw_table(refs, group_refs, gpu_blocks, cpu_chunks, blocks_per_chunk):
    as_int64 = lambda values: np.array(values, dtype=np.int64)
    return _C.PageTable(refs, as_int64(group_refs), as_int64(gpu_blocks), as_int64(cpu_chunks),
                        blocks_per_chunk, as_int64([]))


@pytest.mark.parametrize("bad", [[1], np.array([1.0]), np.array([1], np.int32), np.array([[1]], np.int64)])
def test_the_binding_takes_the_packages_int64_vectors_unconverted(bad):
    refs = np.zeros((0, 5), np.int64)
    with pytest.raises(TypeError):
        _C.PageTable(refs, bad, np.array([4]), np.array([0]), 1, np.zeros(0, np.int64))
    table = small_table()
    job = table.prepare([0], [0], [1, 0], [0, 0])
    with pytest.raises(TypeError):
        table.keys(job, bad, np.array([0, 0]))


def test_a_few_ids_over_a_vast_block_count_are_checked_in_memory_of_their_size():
    # 2^60 blocks: bits for every one would be 2^57 bytes.
    rng = np.random.default_rng(7)
    table = raw_table(np.zeros((0, 5), np.int64), [0], [1 << 60], [4], 1)
    ids = rng.integers(0, 1 << 60, size=3, dtype=np.int64)
    table.check(ids, [0, 1, 2], [3], [0])
    with pytest.raises(ValueError, match=rf"^group 0: block_ids\[2\] = {ids[0]} appears twice$"):
        table.check([ids[0], ids[1], ids[0]], [0, 1, 2], [3], [0])
    with pytest.raises(ValueError, match=r"^group 0: block_ids\[1\] = 1152921504606846976 is out of range"):
        table.check([ids[0], 1 << 60, ids[0]], [0, 1, 2], [3], [0])


def test_a_chunk_size_near_2_63_cannot_wrap_a_jobs_chunk_count():
    # No chunks (or no tensors) leave blocks_per_chunk unbounded by any extent.
    refs = np.array([[1 << 30, 64, 1, 1 << 40, 2**63 - 1]], np.int64)
    with pytest.raises(ValueError, match=r"^group 0: 4 blocks and blocks_per_chunk 9223372036854775807 add up past"):
        raw_table(refs, [1], [4], [0], 2**63 - 1)
    table = raw_table(np.zeros((0, 5), np.int64), [0], [4], [0], 2**63 - 5)
    with pytest.raises(ValueError, match=r"^chunk_ids: has 0 ids but the groups use 2 chunks"):
        table.check([0, 1], [], [2], [2**63 - 6])


def test_layouts_whose_extent_wraps_are_refused():
    # KVLayout itself now refuses it, before the page table sees it.
    with pytest.raises(ValueError, match=r"group 0 tensor 0: its GPU extent ends past 2\^63"):
        page_table(KVLayout((GroupLayout((TensorLayout(1 << 62, 1 << 40, 64, 1 << 30, 64),), 1 << 23, 1),), 1))


def test_copy_without_a_gpu_raises_after_checking_the_ids():
    import kvoffload as kv

    table = small_table()
    with pytest.raises(ValueError, match="appears twice"):
        table.copy([1, 1], [0], [2, 0], [0, 0], direction=LOAD, stream=None)
    if not _has_gpu():
        with pytest.raises(kv.NoCudaDeviceError):
            table.copy([0, 1], [0, 1], [1, 1], [0, 0], direction=LOAD, stream=None)


def _has_gpu():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("seed", range(40))
def test_groups_sharing_cpu_tensors_key_parts_that_every_sub_block_covers_whole_or_not_at_all(seed):
    # A key's bytes are those of one signature (the sub-blocks that cover them): then a
    # job touching a key touches all of its bytes, and jobs share a key where they share
    # a byte. Groups share tensor T, with pages of their own, and may have tensors of their own.
    rng = np.random.default_rng(seed)
    bpc, chunks, blocks, n = int(rng.integers(1, 5)), 3, 8, int(rng.integers(2, 4))
    pages = [[int(p) for p in rng.choice([128, 256, 384, 512], 1 + int(rng.integers(0, 2)))] for _ in range(n)]
    pitches = [max(p[0] for p in pages)] + [p[1] for p in pages if len(p) > 1]
    stride, at, groups, own = bpc * sum(pitches), 1 << 40, [], 1
    for g, group in enumerate(pages):
        tensors = [TensorLayout(1 << 30, 4096, group[0], at, stride)]
        if len(group) > 1:
            tensors.append(TensorLayout((g + 2) << 30, 4096, group[1], at + bpc * sum(pitches[:own]), stride))
            own += 1
        groups.append(GroupLayout(tuple(tensors), blocks, chunks))
    layout = KVLayout(tuple(groups), bpc)
    parts = ChunkParts.of(layout)
    gpu_offset, cpu_offset, _, cpu_keys = key_offsets(layout, parts)
    table = page_table(layout)
    signature_of_byte, signature_of_key = {}, {}
    for g in range(n):
        for c in range(chunks):
            for k in range(bpc):
                sizes, firsts = [int(h == g) for h in range(n)], [k * (h == g) for h in range(n)]
                ids = ([0], [c], sizes, firsts)
                _, keys = table.keys(table.prepare(*ids), gpu_offset, cpu_offset)
                keys = parts.keys(keys, sizes, cpu_offset)
                assert ((0 <= keys) & (keys < cpu_keys)).all() and len(set(keys.tolist())) == len(keys)
                for key in keys.tolist():
                    signature_of_key.setdefault(key, set()).add((g, c, k))
                _, host, size = table.unit_copies(*ids)
                for start, length in zip(host.tolist(), size.tolist()):
                    for byte in range(start, start + length):
                        signature_of_byte.setdefault(byte, set()).add((g, c, k))
    signatures = {frozenset(s) for s in signature_of_byte.values()}
    assert {frozenset(s) for s in signature_of_key.values()} == signatures
    assert len(signature_of_key) == len(signatures)


def test_groups_that_share_one_tensor_with_equal_pages_keep_sub_block_keys():
    layout = KVLayout(tuple(GroupLayout((TensorLayout(1 << 30, 4096, 256, 1 << 40, 1024),), 8, 4)
                            for g in range(2)), 4)
    assert layout.cpu_alias == (0, 0) and ChunkParts.of(layout).of_sub_block == (None, None)
    assert key_offsets(layout, ChunkParts.of(layout))[3] == 16


@pytest.mark.parametrize("options, message", [
    (dict(ring=4), r"ring: must be in \[0, 4\), got 4"),
    (dict(ring=-1), r"ring: must be in \[0, 4\), got -1"),
    (dict(slots=1), r"slots: must be in \[2, 1024\], got 1"),
    (dict(slots=1025), r"slots: must be in \[2, 1024\], got 1025"),
    (dict(slot_bytes=1 << 62, slots=4), r"slot_bytes: must be a multiple of 256 in \[32768, 1099511627776\], got 4611686018427387904"),
    (dict(slot_bytes=65537), r"slot_bytes: must be a multiple of 256 in \[32768, "),
    (dict(max_ctas=0), r"max_ctas: must be >= 1, got 0"),
])
def test_bad_copy_options_are_refused_before_anything_runs(options, message):
    # Refused before the job's device is asked for: no GPU is needed to get here.
    with pytest.raises(ValueError, match=message):
        small_table().copy([0], [0], [1, 0], [0, 0], direction=LOAD, stream=None, **options)
