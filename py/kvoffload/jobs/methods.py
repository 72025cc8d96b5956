"""How a handler copies its jobs: one object per kind of method, made with the handler,
each with one interface: ``plan`` a job at submission, then make its ``copy``.

PageJobs sends a job to the GPU as ids (kvoffload.pages.table); the jobs it must wait for
are found on its lane's enqueue thread. PlannedJobs plans every page on the host, checks
every copy against the handler's registry and copies raw pointers with a copy method
(kvoffload.copy.methods, auto.Auto), or with the host copy where there is no GPU; the
jobs it waits for are found at submission.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Union

from .. import _C
from ..copy.batch_copy import batch_entry_point_version, host_copy
from ..copy.methods import CANDIDATES, CopyMethod, copy_method
from ..copy.ordering import PendingWrites, safe_order
from ..copy.registry import UNCHECKED
from ..costs import calibration, page_calibration
from ..costs.auto import Auto
from ..pages import paths as page_paths
from ..pages.paths import PagePath, Pages
from ..pages.table import transfer_plan
from ..util.vocabulary import Direction, MemoryKind
from .descriptor_pool import DescriptorPool

logger = logging.getLogger(__name__)

Method = Union[str, Pages, Auto, CopyMethod]
NAMES = ("auto",) + tuple(CANDIDATES) + page_paths.NAMES  # every name a handler's method may be


def method_object(method: Method) -> Pages | Auto | CopyMethod:
    """The method a handler's ``method`` names, or the object itself."""
    if isinstance(method, (Pages, Auto)):
        return method
    if isinstance(method, str) and method == "auto":
        return Auto()
    if isinstance(method, str) and method in page_paths.NAMES:
        return Pages.named(method)
    try:
        return copy_method(method)
    except ValueError:
        raise ValueError(f"method: expected one of {NAMES}, or a kvoffload.Pages, kvoffload.Auto or "
                         f"kvoffload.copy.methods object, got {method!r}") from None


def job_method(method: Pages | Auto | CopyMethod, device, layout, table, pool, registry,
               choice: PageChoice | None = None) -> PageJobs | PlannedJobs:
    """What a handler on ``device`` runs its jobs with: the host copy without a GPU. A page
    method takes the paths of ``choice`` (page_choice, made with the handler). An Auto
    method's calibration is loaded, or measured, now rather than in the first job."""
    if device.type != "cuda":
        return PlannedJobs(None, table, pool, MemoryKind.HOST)
    if isinstance(method, Pages):
        if choice is None:
            raise ValueError("choice: a page method on a GPU runs the paths of its page_choice, got None")
        return PageJobs(method, layout, table, registry, choice, device.index)
    if isinstance(method, Auto):
        calibration.calibration(device.index)
    return PlannedJobs(method, table, pool, MemoryKind.DEVICE)


@dataclasses.dataclass(frozen=True)
class PageChoice:
    """Each direction's path for a handler's page jobs, chosen once, and what it was
    chosen from: whether the driver has the batch copy, and the page calibration (for a
    method with a max_slowdown)."""

    paths: dict[Direction, PagePath]
    batch_copy: bool
    cal: object = None
    rows: tuple = ()  # per group: None, or why its tensors are not rows of one allocation
    # DMA moves every group's blocks by 2D copies, a row per tensor, from a chunk-major
    # pool; only where every group's tensors are rows and every page is under
    # ROWS_BELOW_PAGE_BYTES (a group apart would take a per-tensor pool, whose 2D copies
    # crawl: rows a region apart).
    by_rows: bool = False

    @classmethod
    def of(cls, method: Pages, pages, batch_copy: bool, cal=None, rows=()) -> PageChoice:
        small = max((p for group in pages for p in group), default=0) < page_paths.ROWS_BELOW_PAGE_BYTES
        every = method.strided and small and bool(rows) and all(r is None for r in rows)
        paths = page_paths.choose(method, pages, batch_copy, cal, every)
        return cls(paths, batch_copy, cal, tuple(rows), every and PagePath.DMA in paths.values())

    def without_rows(self, method: Pages, pages) -> PageChoice:
        """The choice as if no group's tensors were rows."""
        return PageChoice.of(method, pages, self.batch_copy, self.cal)


def page_choice(method: Pages | Auto | CopyMethod, device, pages, gpu_tensors=()) -> PageChoice | None:
    """The paths of a page method on ``device`` over tensors of ``pages[g][t]`` page bytes
    (``gpu_tensors``, [group][tensor]); None for other methods and without a GPU. The
    pool's default layout and the page jobs both follow it."""
    if device.type != "cuda" or not isinstance(method, Pages):
        return None
    cal = page_calibration.page_calibration(device.index) if method.max_slowdown is not None else None
    rows = [page_paths.rows_why_not(g, p) for g, p in zip(gpu_tensors, pages) if g]
    choice = PageChoice.of(method, pages, batch_entry_point_version() > 0, cal, rows)
    if method.slots_in_l2 and PagePath.STAGED in choice.paths.values():
        _C.require_fits_l2(device.index, method.slot_bytes, method.slots)
    return choice


def cpu_layout_for(choice: PageChoice | None, own_pool: bool = True) -> str:
    """The pool layout a handler takes where it names none: page_paths.cpu_layout for
    the paths of its page jobs (``choice``) with ``own_pool`` (a pool that only it sees,
    pinned before it returns), else chunk-major. A shared pool's layout must not hang on
    one rank's choice, and a pool pinned in the background serves the jobs on its first
    chunks early only when chunk-major. A choice whose DMA goes by rows takes chunk-major too:
    per tensor, a 2D copy's host rows lie a tensor's region apart, and on an H100 such
    copies moved 8 KiB pages at a third of the rate of a block's rows back to back."""
    if choice is None or not own_pool or choice.by_rows:
        # By rows: a chunk's tensors back to back keep the host pitch one chunk's page
        # (within the device's largest pitch) and a copy inside one registration.
        return "chunk_major"
    return page_paths.cpu_layout(choice.paths)


@dataclasses.dataclass
class JobCopy:
    """What a job runs on its lane: ``copy(stream)``; ``resolve(handle)`` on the lane's
    enqueue thread gives (waits, sources), or None where they were given at submission;
    ``pipelined``: the copy's stages may overlap the lane's next job's (the ring)."""

    copy: Callable
    resolve: Callable | None = None
    pipelined: bool = False
    descriptors: object = None  # PlannedJobs' arrays, given back by release()


class PageJobs:
    """A page method on a GPU: every page a job names lies inside the extents checked
    here once, so a job needs only its ids checked (by the page table, at submission)."""

    resolves_on_lane = True
    descriptor_arrays_allocated = 0

    def __init__(self, method: Pages, layout, table, registry, choice: PageChoice, device: int | None = None):
        self._layout, self._table = layout, table
        self._ring = dict(max_ctas=method.ctas, slot_bytes=method.slot_bytes, slots=method.slots,
                          slots_in_l2=method.slots_in_l2, strided=choice.by_rows,
                          row_batches=method.row_batches, rows_per_copy=method.rows_per_copy,
                          prefer_overlap=method.prefer_overlap)
        self.paths = choice.paths
        cal = choice.cal
        gpu_spans, cpu_spans = table.spans()
        tensors = [(g, t) for g, group in enumerate(layout.groups) for t in group.tensors]
        for (g, t), gpu_span, cpu_span in zip(tensors, gpu_spans.tolist(), cpu_spans.tolist()):
            if gpu_span:
                registry.check([t.gpu_base], [gpu_span], MemoryKind.DEVICE, f"group {g} GPU extent")
            if cpu_span:
                registry.check([t.cpu_base], [cpu_span], MemoryKind.HOST, f"group {g} CPU extent")
        page = page_paths.mean_page_bytes(page_paths.layout_pages(layout))
        if method.slots_in_l2 and PagePath.STAGED in self.paths.values():
            logger.warning("kvoffload: the staging ring's slots are held in persisting L2; the set-aside "
                           "slows every step of a model on this device (docs/studies.md)")
        rows = table.rows(device) if device is not None and choice.by_rows else []
        strided = [g for g, r in enumerate(rows) if r[0]]
        per_page = [f"group {g}: {r[1]}" for g, r in enumerate(rows) if not r[0] and r[2] > 0]
        refused = bool(per_page)
        if refused:
            # The driver said no (another allocation, a pitch past the device's largest):
            # the choice without rows, no 2D copies at all.
            self.paths = choice.without_rows(method, page_paths.layout_pages(layout)).paths
            self._ring["strided"] = False
            refusal = "the tensors are not rows the driver copies in 2D (" + ", ".join(per_page) + ")"
            strided = per_page = []
        by_rows = choice.by_rows and not refused
        for d in Direction if cal is not None else ():
            if cal.noisy_at(d, page, by_rows):
                logger.warning("kvoffload: the page calibration's %s figures near %.0f page bytes were "
                               "noisy; measure again with python -m kvoffload.costs.page_calibration "
                               "--recalibrate", d.value, page)
        if cal is not None:
            why = cal.why(self.paths[Direction.STORE], page, method.max_slowdown, choice.batch_copy,
                          by_rows) + (f"; {refusal}" if refused else "")
        elif refused:
            why = f"built-in choice: {refusal}"
        elif choice.by_rows:
            why = "built-in choice: every group's tensors are rows of one allocation"
        else:
            why = "built-in choice"
        if strided:
            why += f"; DMA by 2D copies, a row per tensor, for group{'s' * (len(strided) > 1)} {strided}"
        if per_page:
            why += "; DMA per page for " + ", ".join(per_page)
        self.reasons = {d.value: why for d in self.paths}
        logger.info("kvoffload: %s page bytes on average: stores by %s, loads by %s (%s)", f"{page:.0f}",
                    page_paths.name(self.paths[Direction.STORE]), page_paths.name(self.paths[Direction.LOAD]), why)

    @property
    def methods(self) -> dict[str, str]:
        return {d.value: page_paths.name(p) for d, p in self.paths.items()}

    def plan(self, direction, prepared, gpu, registry) -> tuple[int, None]:
        """(bytes, plan) of a job. Page jobs check no copies, so the tensors' storage is
        checked here (the registry's check_copies does it for planned jobs)."""
        del direction, prepared
        registry.check_tensors()
        groups = self._layout.groups
        return sum(n * t.page_bytes for n, group in zip(gpu.group_sizes, groups) for t in group.tensors), None

    def copy(self, job, prepared, plan, sources, resolve, done) -> JobCopy:
        """Expedited loads take a ring of their own: they never queue behind the load
        lane's. DMA loads choose their source order as they are enqueued
        (_quiet_source_reads); the ring and the kernel read in stream order."""
        del plan, sources
        path = self.paths[job.direction]
        copy = functools.partial(self._table.copy_job, prepared, direction=job.direction.native, path=path,
                                 ring=int(job.lane == "expedited"), **self._ring)
        if job.direction is Direction.LOAD and path == PagePath.DMA:
            copy, resolve = _quiet_source_reads(copy, resolve, done)
        return JobCopy(copy, resolve, pipelined=path == PagePath.STAGED)

    def release(self, copy: JobCopy) -> None:
        pass


class PlannedJobs:
    """A raw-pointer copy method (or, with ``method`` None, the host copy on CPU tensors)
    over copies planned on the host, in a pool's registrations."""

    resolves_on_lane = False

    def __init__(self, method: Auto | CopyMethod | None, table, pool, gpu_kind: MemoryKind):
        self._method, self._table, self._pool, self._gpu_kind = method, table, pool, gpu_kind
        self._descriptors = DescriptorPool()

    @property
    def methods(self) -> dict[str, str]:
        return {d.value: "host" if self._method is None else self._method.name for d in Direction}

    @property
    def reasons(self) -> dict[str, str]:
        return {d.value: "no GPU: host threads" if self._method is None else "the handler's method" for d in Direction}

    @property
    def descriptor_arrays_allocated(self) -> int:
        return self._descriptors.allocated

    def plan(self, direction, prepared, gpu, registry):
        """(bytes, copies) of a job: its (src, dst, sizes), cut where the pool's registrations
        end, each checked against the registry."""
        del gpu
        plan = self._pool.split_plan(transfer_plan(self._table, prepared, direction))
        copies = plan.load() if direction is Direction.LOAD else plan.store()
        registry.check_copies(*copies, *direction.ends(MemoryKind.HOST, self._gpu_kind))
        return plan.total_bytes, copies

    def copy(self, job, prepared, plan, sources, resolve, done) -> JobCopy:
        """A load may read its source out of stream order where no store it reads is in
        flight (kvoffload.copy.ordering)."""
        del prepared, resolve, done
        load = job.direction is Direction.LOAD
        pending = (PendingWrites.YES if sources else PendingWrites.NO) if load else PendingWrites.UNKNOWN
        order = safe_order(*job.direction.kinds, pending)
        src, dst, sizes = plan
        descriptors = self._descriptors.acquire(src, dst, sizes)
        n = len(sizes)
        rows = (descriptors[0, :n], descriptors[1, :n], descriptors[2, :n])
        if self._method is None:
            copy = functools.partial(host_copy, *rows, registry=UNCHECKED)
        else:
            copy = functools.partial(self._method, *rows, direction=job.direction, order=order, registry=UNCHECKED)
        return JobCopy(copy, descriptors=descriptors)

    def release(self, copy: JobCopy) -> None:
        if copy.descriptors is not None:
            self._descriptors.release(copy.descriptors)
            copy.descriptors = None


def _quiet_source_reads(copy, resolve, done):
    """A DMA page load's (copy, resolve): the copy reads the pool out of stream order
    (SrcAccessOrder.ANY, as vLLM's worker reads its loads) when no store it reads from is
    still in flight as it is enqueued, and in stream order (after the stores) when one is."""
    stores = []

    def resolve_noting_stores(handle):
        waits, sources = resolve(handle)
        stores[:] = sources
        return waits, sources

    def copy_in_order(stream):
        quiet = all(done(store) for store in stores)
        return copy(stream=stream, src_order=_C.SrcAccessOrder.ANY if quiet else _C.SrcAccessOrder.STREAM)

    return copy_in_order, resolve_noting_stores
