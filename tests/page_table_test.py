"""kvoffload.page_table without a GPU: the units a job's kernels copy are the planner's
descriptors, and bad ids and layouts are refused before anything is enqueued."""

import numpy as np
import pytest
from hypothesis import given, settings

from kvoffload.page_table import UNIT_BYTES, job_arguments, page_table
from kvoffload.planner import GroupLayout, KVLayout, TensorLayout, plan_transfer
from layouts import transfers


def as_units(gpu, cpu, sizes):
    """Descriptors cut into units, sorted: the same bytes compare equal however cut."""
    rows = [(g + o, c + o, min(UNIT_BYTES, n - o))
            for g, c, n in zip(gpu.tolist(), cpu.tolist(), sizes.tolist())
            for o in range(0, n, UNIT_BYTES)]
    return sorted(rows)


@settings(max_examples=300, deadline=None)
@given(transfers())
def test_units_are_the_planners_descriptors(transfer):
    layout, gpu, cpu = transfer
    plan = plan_transfer(layout, gpu, cpu, coalesce=False)
    table = page_table(layout)
    units = table.unit_copies(*job_arguments(gpu, cpu))
    assert all(u.dtype == np.int64 for u in units)
    assert as_units(*units) == as_units(plan.gpu, plan.cpu, plan.sizes)


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
    table.check([0, 1], [0, 1], [1, 1], [0, 0])  # the table is still usable


def test_bad_id_arrays_are_type_errors():
    table = small_table()
    with pytest.raises(TypeError, match="block_ids: expected dtype int64"):
        table.check(np.array([0, 1], np.int32), [0, 1], [1, 1], [0, 0])
    with pytest.raises(ValueError, match="chunk_ids: expected a 1-D array"):
        table.check([0, 1], np.zeros((1, 2), np.int64), [1, 1], [0, 0])


def test_layouts_whose_extent_wraps_are_refused():
    with pytest.raises(ValueError, match="runs past the end of the address space"):
        page_table(KVLayout((GroupLayout((TensorLayout(1 << 62, 1 << 40, 64, 1 << 30, 64),), 1 << 23, 1),), 1))


def test_copy_without_a_gpu_raises_after_checking_the_ids():
    import kvoffload as kv

    table = small_table()
    with pytest.raises(ValueError, match="appears twice"):
        table.copy([1, 1], [0], [2, 0], [0, 0], load=True, stream=None)
    if not _has_gpu():
        with pytest.raises(kv.NoCudaDeviceError):
            table.copy([0, 1], [0, 1], [1, 1], [0, 0], load=True, stream=None)


def _has_gpu():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
