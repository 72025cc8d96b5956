"""kvoffload.pages.paths: which path a handler's page jobs take, by layout and direction."""

import numpy as np
import pytest

from kvoffload.pages import paths as page_methods
from kvoffload.pages.paths import DMA_FROM_PAGE_BYTES, PagePath
from kvoffload.util.vocabulary import Direction


@pytest.mark.parametrize("direction", list(Direction))
def test_pages_at_or_above_the_threshold_go_by_dma_below_it_staged(direction):
    edge = DMA_FROM_PAGE_BYTES[direction]
    assert page_methods.choose(page_methods.Pages(), [[edge] * 3])[direction] == PagePath.DMA
    assert page_methods.choose(page_methods.Pages(), [[edge - 16] * 3])[direction] == PagePath.STAGED
    # The mean over every tensor of every group decides.
    assert page_methods.choose(page_methods.Pages(), [[edge // 2], [3 * edge // 2]])[direction] == PagePath.DMA
    assert page_methods.choose(page_methods.Pages(), [[edge // 2], [edge // 2, 3 * edge // 2 - 32]])[direction] \
        == PagePath.STAGED


def test_without_the_drivers_batch_copy_pages_keep_to_the_ring():
    big = [[1 << 20]]
    assert page_methods.choose(page_methods.Pages(), big, batch_copy=False) == {d: PagePath.STAGED for d in Direction}
    assert page_methods.choose(page_methods.Pages(PagePath.DMA), big, batch_copy=False) == {d: PagePath.DMA for d in Direction}


def test_a_forced_method_takes_its_path_both_ways_and_names_it_back():
    for name, path in page_methods.FORCED.items():
        assert page_methods.choose(page_methods.Pages.named(name), [[4096], [1 << 20]]) == {d: path for d in Direction}
        assert page_methods.name(path) == name


def test_the_pool_goes_per_tensor_only_where_dma_takes_both_ways():
    DMA, STAGED, KERNEL = PagePath.DMA, PagePath.STAGED, PagePath.KERNEL
    assert page_methods.cpu_layout({d: DMA for d in Direction}) == "per_tensor"
    for other in (STAGED, KERNEL):
        assert page_methods.cpu_layout({d: other for d in Direction}) == "chunk_major"
        assert page_methods.cpu_layout({Direction.STORE: DMA, Direction.LOAD: other}) == "chunk_major"
        assert page_methods.cpu_layout({Direction.STORE: other, Direction.LOAD: DMA}) == "chunk_major"


def test_a_page_method_object_names_its_bad_options():
    with pytest.raises(ValueError, match="ctas: must be >= 1, got 0"):
        page_methods.Pages(ctas=0)
    with pytest.raises(ValueError, match=f"ctas: must be <= {page_methods.Pages.MAX_CTAS}"):
        page_methods.Pages(ctas=page_methods.Pages.MAX_CTAS + 1)
    with pytest.raises(TypeError, match="ctas: expected an int, got bool"):
        page_methods.Pages(ctas=True)
    with pytest.raises(ValueError, match="path: expected None or one of"):
        page_methods.Pages(path="dma")
    with pytest.raises(ValueError, match="slot_bytes: must be >= "):
        page_methods.Pages(slot_bytes=4096)
    with pytest.raises(ValueError, match="slot_bytes: must be a multiple of 256, got 65537"):
        page_methods.Pages(slot_bytes=65537)
    with pytest.raises(ValueError, match="slots: must be >= 2, got 1"):
        page_methods.Pages(slots=1)
    with pytest.raises(ValueError, match="slots: must be <= 1024, got 1025"):
        page_methods.Pages(slots=1025)
    with pytest.raises(ValueError, match="slot_bytes: must be <= 1099511627776"):
        page_methods.Pages(slot_bytes=1 << 62)
    ring = page_methods.Pages(slot_bytes=np.int64(1 << 20), slots=np.int32(3))
    assert type(ring.slot_bytes) is int and type(ring.slots) is int and (ring.slot_bytes, ring.slots) == (1 << 20, 3)
    with pytest.raises(TypeError, match="slots_in_l2: expected a bool, got int"):
        page_methods.Pages(slots_in_l2=1)
    for flag in ("strided", "row_batches", "prefer_overlap"):
        with pytest.raises(TypeError, match=f"{flag}: expected a bool, got str"):
            page_methods.Pages(**{flag: "yes"})
    with pytest.raises(ValueError, match="rows_per_copy: must be >= 0"):
        page_methods.Pages(rows_per_copy=-1)
    assert page_methods.Pages(rows_per_copy=np.int64(8)).rows_per_copy == 8
    assert page_methods.Pages(PagePath.DMA, ctas=4).name == "pages_dma"
    assert page_methods.Pages().name == "pages"
    assert page_methods.Pages.named("pages") == page_methods.Pages()
    with pytest.raises(ValueError, match="method: expected one of"):
        page_methods.Pages.named("kernel")


def test_layers_of_one_allocation_are_rows_and_small_pages_then_go_by_dma():
    import torch

    layers, blocks, page = 6, 10, 4096
    backing = torch.randint(0, 100, (layers * blocks * page,), dtype=torch.uint8)
    one = [backing[i * blocks * page:(i + 1) * blocks * page].view(blocks, page) for i in range(layers)]
    assert page_methods.rows_why_not(one, [page] * layers) is None
    # Every other layer (a hybrid model's group) is still a constant distance apart.
    assert page_methods.rows_why_not(one[::2], [page] * 3) is None
    assert page_methods.rows_why_not(one[:1], [page]) == "one tensor"
    assert page_methods.rows_why_not([one[0], one[2], one[3]], [page] * 3) == \
        "tensors are not a constant distance apart"
    assert page_methods.rows_why_not(one[:2], [page, page // 2]) == "tensors differ in page size or stride"
    assert page_methods.rows_why_not(one[::-1], [page] * layers) == "tensors overlap or run backwards"
    assert page_methods.rows_why_not([one[0], one[0]], [page] * 2) == "tensors overlap or run backwards"
    apart = [torch.zeros(blocks, page, dtype=torch.uint8) for _ in range(3)]
    assert page_methods.rows_why_not(apart, [page] * 3) == "the tensors are separate allocations"
    # Rows, never SMs, for small pages by default; without the batch copy, the ring.
    small = [[page] * layers]
    assert page_methods.choose(page_methods.Pages(), small, rows=True) == {d: PagePath.DMA for d in Direction}
    assert page_methods.choose(page_methods.Pages(), small, rows=False) == {d: PagePath.STAGED for d in Direction}
    assert page_methods.choose(page_methods.Pages(), small, batch_copy=False, rows=True) == \
        {d: PagePath.STAGED for d in Direction}
