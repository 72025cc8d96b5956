"""How a handler's page jobs cross the link, chosen when it is made.

A copy engine moves a large page at the link's rate without an SM, so beside a model it
costs what any DMA costs; small pages leave the driver's per-copy time in charge, and
there the staging ring (one DMA per host run, a kernel on the HBM side) is the fast
path. But where every group's tensors are rows of one allocation (vLLM's own cache,
``LBHNC``: a layer's pages a constant stride apart), one 2D DMA moves a block across all
of them, at a DMA's cost to the model. By default ``choose`` takes DMA there, and where
the mean page is at least ``DMA_FROM_PAGE_BYTES`` for that direction (measured beside the
model loop: bench/results/README.md, the method-per-layout and vLLM-cache runs); else
the ring. Given a ``max_slowdown``, it chooses from this device's page calibration
instead (kvoffload.costs.page_calibration), whose ring moves small pages fastest.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .. import _C
from ..util.arguments import check_max_slowdown, require_int
from ..util.vocabulary import Direction

PagePath = _C.PagePath

# The handler's page methods: "pages" chooses per direction, the others force a path.
FORCED = {"pages_staged": PagePath.STAGED, "pages_kernel": PagePath.KERNEL, "pages_dma": PagePath.DMA}
NAMES = ("pages",) + tuple(FORCED)  # the names a page method may be given by
DMA_FROM_PAGE_BYTES = {Direction.STORE: 20 << 10, Direction.LOAD: 20 << 10}
# 2D copies (a row per tensor) for smaller pages only: at 64 KiB a copy per page moved
# more (54 against 50.7 GB/s alone on the H200, bench/results/dma2d_probe_h200.json).
ROWS_BELOW_PAGE_BYTES = 20 << 10
PAGE_CTAS = _C.PAGE_COPY_CTAS  # the gather and scatter kernels' CTAs (cc/pages/page_copy.h)
SLOT_BYTES, SLOTS = _C.PAGE_SLOT_BYTES, _C.PAGE_SLOTS  # the staging ring's


def layout_pages(layout) -> list[list[int]]:
    """A KVLayout's page bytes, [group][tensor]."""
    return [[t.page_bytes for t in group.tensors] for group in layout.groups]


def mean_page_bytes(pages) -> float:
    """The mean bytes of one tensor's page over every tensor of every group, from
    ``pages[g][t]``."""
    flat = [page for group in pages for page in group]
    return sum(flat) / len(flat) if flat else 0.0


@dataclasses.dataclass(frozen=True)
class Pages:
    """A handler's page method: each job goes to the GPU as ids. ``path``: every page by
    that PagePath, or None ("pages") to choose from the layout (``choose``).
    ``ctas``: the gather and scatter kernels' CTAs. ``max_slowdown``: with path None, the
    step slowdown over bulk copies' that a model beside may be given, chosen by from the
    device's page calibration; None: the built-in choice. ``slots`` x ``slot_bytes``: the
    staging ring. ``strided``: where every group's tensors are rows of one allocation and
    every page is under ROWS_BELOW_PAGE_BYTES, DMA moves blocks by 2D copies
    (cc/pages/row_copies.h) from a chunk-major pool; False keeps to a copy per page. ``row_batches`` sends those 2D
    copies many to a driver call (cuMemcpy3DBatchAsync): a study until measured beside a
    model. ``rows_per_copy``: 0, a 2D copy spans all of its group's rows; else at most that
    many, each group's copies band by band (cc/pages/row_copies.h). ``prefer_overlap``: DMA
    copies carry the driver's hint to overlap with compute: a study. ``slots_in_l2`` holds
    its slots in persisting L2: a study, not a speed-up.
    The device-wide set-aside it leaves slows a model's every step (docs/studies.md#the-ring-in-persisting-l2)."""

    path: PagePath | None = None
    ctas: int = PAGE_CTAS
    max_slowdown: float | None = None
    slot_bytes: int = SLOT_BYTES
    slots: int = SLOTS
    slots_in_l2: bool = False
    strided: bool = True
    row_batches: bool = False
    rows_per_copy: int = 0
    prefer_overlap: bool = False
    MAX_CTAS: ClassVar[int] = 1 << 16

    def __post_init__(self):
        if self.path is not None and self.path not in FORCED.values():
            raise ValueError(f"path: expected None or one of {list(FORCED.values())}, got {self.path!r}")
        require_int("ctas", self.ctas, 1, self.MAX_CTAS)
        object.__setattr__(self, "slot_bytes",
                           require_int("slot_bytes", self.slot_bytes, _C.PAGE_UNIT_BYTES, _C.PAGE_MAX_SLOT_BYTES))
        if self.slot_bytes % 256:
            raise ValueError(f"slot_bytes: must be a multiple of 256, got {self.slot_bytes}")
        object.__setattr__(self, "slots", require_int("slots", self.slots, 2, _C.PAGE_MAX_SLOTS))
        if not isinstance(self.slots_in_l2, bool):
            raise TypeError(f"slots_in_l2: expected a bool, got {type(self.slots_in_l2).__name__}")
        for flag in ("strided", "row_batches", "prefer_overlap"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag}: expected a bool, got {type(getattr(self, flag)).__name__}")
        object.__setattr__(self, "rows_per_copy", require_int("rows_per_copy", self.rows_per_copy, 0, 1 << 31))
        if self.max_slowdown is not None:
            if self.path is not None:
                raise ValueError(f"max_slowdown: chooses a path, and path {name(self.path)!r} is forced")
            check_max_slowdown(self.max_slowdown)

    @classmethod
    def named(cls, method: str) -> Pages:
        """The page method of that name (one of NAMES)."""
        if method not in NAMES:
            raise ValueError(f"method: expected one of {NAMES}, got {method!r}")
        return cls(FORCED.get(method))

    @property
    def name(self) -> str:
        return "pages" if self.path is None else name(self.path)


def rows_why_not(group, pages) -> str | None:
    """None where one group's GPU tensors (with ``pages[t]`` page bytes) can be the rows of
    one 2D copy a block: two or more views of one storage with one page size and one
    block stride, their starts a constant distance apart of at least a page; else why not.
    The page table asks the driver again, with the host side (DevicePageTable::rows)."""
    if len(group) < 2:
        return "one tensor"
    if len({t.untyped_storage().data_ptr() for t in group}) > 1:
        return "the tensors are separate allocations"
    strides = {t.stride(0) * t.element_size() for t in group}
    if len(set(pages)) > 1 or len(strides) > 1:
        return "tensors differ in page size or stride"
    starts = [t.data_ptr() for t in group]
    pitch = starts[1] - starts[0]
    if pitch < pages[0]:
        return "tensors overlap or run backwards"
    if any(b - a != pitch for a, b in zip(starts, starts[1:])):
        return "tensors are not a constant distance apart"
    return None


def choose(method: Pages, pages, batch_copy: bool = True, cal=None,
           rows: bool = False) -> dict[Direction, PagePath]:
    """Each direction's path for a page method on tensors of ``pages[g][t]`` page bytes.
    batch_copy: whether the driver has cuMemcpyBatchAsync; without it DMA goes one driver
    call a page, and "pages" keeps to the ring. cal: the device's PageCalibration, for a
    method with a max_slowdown. rows: every group's tensors are rows of one allocation
    (rows_why_not)."""
    if method.path is not None:
        return {d: method.path for d in Direction}
    page = mean_page_bytes(pages)
    if method.max_slowdown is not None:
        if cal is None:
            raise ValueError("cal: a page method with a max_slowdown chooses from a page calibration, got None")
        path = cal.choose(page, method.max_slowdown, batch_copy, rows)
        return {d: path for d in Direction}
    return {d: PagePath.DMA if batch_copy and (rows or page >= DMA_FROM_PAGE_BYTES[d]) else PagePath.STAGED
            for d in Direction}


def cpu_layout(paths: dict[Direction, PagePath]) -> str:
    """The pool layout for a handler whose page jobs take ``paths`` and that names none:
    each tensor's chunks together where DMA takes both ways (beside a model a copy engine
    loses rate with the span its copies touch, docs/studies.md#dma-address-spread), else
    chunk by chunk, whose chunks are the ring's host runs."""
    return "per_tensor" if all(p == PagePath.DMA for p in paths.values()) else "chunk_major"


def name(path) -> str:
    """The method name that forces ``path``."""
    return next(m for m, p in FORCED.items() if p == path)
