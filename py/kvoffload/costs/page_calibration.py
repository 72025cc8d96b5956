"""What each page path costs a model beside it on this device, by page bytes and
direction: what kvoffload.Pages(max_slowdown=...) chooses by.

At each of PAGE_BYTES it lays out TENSORS tensors of that page in one allocation (vLLM
0.32 and later's LBHNC) and a pinned pool, and keeps jobs (JOB_BYTES each, disjoint, two in
flight, as a handler's lane runs them) of each of VARIANTS going through the C++ page
table: DMA a copy per page, DMA by 2D copies a row per tensor, and the staging ring. Each runs beside the loop of kvoffload.meter.CALIBRATION_WORKLOAD, with bulk copies
in the same run; the record is its rate alone and beside the loop and the loop's step
slowdown over the bulk copies'. Cached beside the raw-pointer calibration
(kvoffload.costs.cache) under the device's key and "pages", and measured again by

    python -m kvoffload.costs.page_calibration --recalibrate [--device N]
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import ClassVar

import numpy as np

from ..pages.paths import PagePath, cpu_layout, name
from ..util.vocabulary import Direction
from . import cache as calibration_cache
from .cache import increasing, interpolate, numbers
from .rule import fastest_within

PAGE_BYTES = [4 << 10, 16 << 10, 64 << 10]
TENSORS = 32
JOB_BYTES = 128 << 20
JOBS = 4  # taken in turn, two in flight; even, as the ring's alternate two streams
PATHS = (PagePath.DMA, PagePath.STAGED)
ROWS = "pages_dma_rows"
# The variants measured, by name: (path, whether the tensors are rows of one allocation).
VARIANTS = {name(PagePath.DMA): (PagePath.DMA, False), ROWS: (PagePath.DMA, True),
            name(PagePath.STAGED): (PagePath.STAGED, False)}
SUFFIX = " | pages"
TIE = 0.05  # rates beside the loop this close count as equal


def variant(path: PagePath, rows: bool = False) -> str:
    """The name of what ``path`` runs as: DMA over rows of one allocation goes by 2D copies."""
    return ROWS if rows and path == PagePath.DMA else name(path)


@dataclasses.dataclass
class PageCalibration:
    key: str
    page_bytes: list[int]
    # "variant direction" (pages_dma store, pages_dma_rows load, ...) -> per page size:
    alone: dict[str, list[float]]  # GB/s with nothing beside
    beside: dict[str, list[float]]  # GB/s beside the loop
    over_bulk: dict[str, list[float]]  # step slowdown less the bulk copies'
    noisy: dict[str, list[bool]]  # |idle drift| over kvoffload.meter.NOISE, copies short of a window, or dry steps
    bulk_slowdown: dict[str, float]  # direction -> the bulk copies' step slowdown
    # 6: on page tables, with 2D copies over one allocation (5: through handlers; 4: all
    # chunk-major; 3: the prefill loop)
    FORMAT: ClassVar[int] = 6
    MODULE: ClassVar[str] = "kvoffload.costs.page_calibration"  # whose --recalibrate measures it
    NEEDED_BY: ClassVar[str] = "Pages(max_slowdown)"

    def valid(self) -> bool:
        """Whether the fields read from a file make a calibration: page sizes increasing
        ints, rates >= 0, every number finite."""
        names = {f"{v} {d.value}" for v in VARIANTS for d in Direction}
        sizes = self.page_bytes
        if not (isinstance(self.key, str) and increasing(sizes) and sizes):
            return False
        n = len(sizes)
        tables = (self.alone, self.beside, self.over_bulk, self.noisy)
        if not all(isinstance(t, dict) and set(t) == names for t in tables):
            return False
        rates = (*self.alone.values(), *self.beside.values())
        return (all(numbers(t) and len(t) == n for t in (*rates, *self.over_bulk.values()))
                and all(v >= 0 for t in rates for v in t)
                and all(isinstance(t, list) and len(t) == n and all(isinstance(v, bool) for v in t)
                        for t in self.noisy.values())
                and isinstance(self.bulk_slowdown, dict) and set(self.bulk_slowdown) == {d.value for d in Direction}
                and numbers(list(self.bulk_slowdown.values())))

    def cost(self, path: PagePath, direction: Direction, page_bytes: float, rows: bool = False) -> float:
        """The step slowdown over bulk copies', log-interpolated in page bytes. rows: the
        tensors are rows of one allocation (their DMA goes by 2D copies)."""
        return interpolate(self.page_bytes, self.over_bulk[f"{variant(path, rows)} {direction.value}"], page_bytes)

    def worst_cost(self, path: PagePath, page_bytes: float, rows: bool = False) -> float:
        """The costlier direction's cost()."""
        return max(self.cost(path, d, page_bytes, rows) for d in Direction)

    def noisy_at(self, direction: Direction, page_bytes: float, rows: bool = False) -> bool:
        """Whether a figure that the choice at page_bytes interpolates from was noisy."""
        i = int(np.searchsorted(self.page_bytes, page_bytes))
        near = {min(max(i - 1, 0), len(self.page_bytes) - 1), min(i, len(self.page_bytes) - 1)}
        return any(self.noisy[f"{variant(p, rows)} {direction.value}"][j] for p in PATHS for j in near)

    def rate(self, path: PagePath, direction: Direction, page_bytes: float, rows: bool = False) -> float:
        """GB/s beside the loop, log-interpolated in page bytes."""
        return interpolate(self.page_bytes, self.beside[f"{variant(path, rows)} {direction.value}"], page_bytes)

    def choose(self, page_bytes: float, max_slowdown: float, batch_copy: bool = True, rows: bool = False) -> PagePath:
        """The one path for both directions, by kvoffload.costs.rule: the fastest beside the
        loop (both ways' rates summed) of those whose costlier direction is within
        ``max_slowdown``, rates within TIE of it going to the cheaper; where none is
        within, the cheapest. Without the driver's batch copy, the ring."""
        # Ring stores beside DMA loads moved 53-55 GB/s both ways, against 96-98 for DMA both
        # ways (bench/results/vllm_worker_page_calibration_h200.json); only that mix was seen
        # to collapse, but one path rules it out.
        return fastest_within(PATHS if batch_copy else (PagePath.STAGED,),
                              lambda p: self.worst_cost(p, page_bytes, rows),
                              lambda p: sum(self.rate(p, d, page_bytes, rows) for d in Direction),
                              max_slowdown, TIE)

    def why(self, path: PagePath, page_bytes: float, max_slowdown: float, batch_copy: bool = True,
            rows: bool = False) -> str:
        """Why choose() took ``path``, for the log."""
        if not batch_copy:
            return "the ring: the driver has no batch copy"
        cost = self.worst_cost(path, page_bytes, rows)
        within = f"within {max_slowdown:.2%}" if cost <= max_slowdown else f"the least; none is within {max_slowdown:.2%}"
        return f"{cost:+.2%} over bulk copies' slowdown by the page calibration, {within}"


def _jobs(rng, n: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` jobs (block ids, chunk ids) of n random blocks to n random chunks, out of
    count * n of each. No two share a block or a chunk: a job that conflicts with the one
    before waits for it, and the ring's stages would not overlap."""
    blocks = rng.permutation(count * n).astype(np.int64).reshape(count, n)
    chunks = rng.permutation(count * n).astype(np.int64).reshape(count, n)
    return list(zip(blocks, chunks))


def page_sources(torch, where: str, job_bytes: int = JOB_BYTES) -> tuple[list, dict]:
    """(held, sources): per page size of PAGE_BYTES, TENSORS tensors as rows of one
    allocation and one pinned pool, which every variant of VARIANTS addresses through a
    page table of its own: the pool laid out as a handler lays its own out for that path,
    the tensors taken a copy per page or as rows. sources[variant, direction, page] makes
    the Copies that keep its jobs in flight; the meter runs one source at a time, so they
    share the memory, which ``held`` keeps alive while they run."""
    from .. import _C
    from ..meter.sources import RawCopies
    from ..pages.table import page_table
    from ..pool.layout import kv_layout, pool_bytes

    rng = np.random.default_rng(0)
    streams = {d: [torch.cuda.Stream(where) for _ in range(2)] for d in Direction}
    held, sources = [], {}
    for page in PAGE_BYTES:
        n = max(1, job_bytes // (TENSORS * page))
        jobs = _jobs(rng, n, JOBS)
        blocks = JOBS * n
        pages = [[page] * TENSORS]
        backing = torch.empty((TENSORS, blocks, page), dtype=torch.uint8, device=where)
        cache = [backing[t] for t in range(TENSORS)]
        pool = torch.empty(pool_bytes(pages, [blocks], 1), dtype=torch.uint8, pin_memory=True)
        held += [backing, pool]
        for key, (path, rows) in VARIANTS.items():
            # A handler lays its pool out chunk-major where DMA goes by rows (jobs.methods.cpu_layout_for).
            layout = kv_layout([cache], pages, [blocks], 1, pool.data_ptr(),
                               "chunk_major" if rows else cpu_layout({d: path for d in Direction}))
            table = page_table(layout)
            held.append(table)
            for d in Direction:
                # As a lane runs them: the ring's jobs on two streams in turn (each job's
                # stages then overlap the one before's), DMA's on one; loads read with ANY
                # (no store in flight).
                ring = path == PagePath.STAGED
                order = _C.SrcAccessOrder.ANY if d == Direction.LOAD and not ring else _C.SrcAccessOrder.STREAM
                on = [streams[d][k % 2 if ring else 0] for k in range(len(jobs))]
                calls = [(functools.partial(table.copy, b, c, [n], [0], direction=d.native, stream=stream, path=path,
                                            strided=rows, src_order=order), n * TENSORS * page, stream)
                         for (b, c), stream in zip(jobs, on)]
                sources[key, d, page] = functools.partial(RawCopies, torch, calls, streams[d][0])
    return held, sources


def measure(device: int, job_bytes: int = JOB_BYTES, **windows) -> PageCalibration:
    """Measures every variant at every page size on ``device``: a few minutes.
    windows: kvoffload.meter.measure's steps, rounds and margin (default: its own)."""
    import torch

    from ..meter import compute_loop, meter
    from ..meter.sources import BulkCopies

    where = f"cuda:{device}"
    with torch.cuda.device(device):
        held, sources = page_sources(torch, where, job_bytes)
        try:
            for d in Direction:  # made once: its pinned buffers are not allocated inside a window
                bulk = BulkCopies(torch, d.value, job_bytes, device=where)
                sources["bulk", d, 0] = lambda bulk=bulk: bulk
            # Alone first: a table's first jobs load its kernels and make its rings.
            rates = {key: meter.alone(make(), seconds=0.3, warm_seconds=0.2) for key, make in sources.items()}
            loop = compute_loop.ComputeLoop(torch, meter.CALIBRATION_WORKLOAD, where)
            got = meter.measure(loop, sources, **windows)
        finally:
            torch.cuda.synchronize(device)  # nothing in flight over the memory freed next
            del held
    bulk_slowdown = {d.value: got["bulk", d, 0].step_slowdown for d in Direction}
    alone, beside, over_bulk, noisy = {}, {}, {}, {}
    for key in VARIANTS:
        for d in Direction:
            results = [got[key, d, page] for page in PAGE_BYTES]
            name_ = f"{key} {d.value}"
            alone[name_] = [rates[key, d, page] for page in PAGE_BYTES]
            beside[name_] = [r.gb_per_s for r in results]
            over_bulk[name_] = [r.step_slowdown - bulk_slowdown[d.value] for r in results]
            # A dry step waited for the host: its slowdown says nothing (kvoffload.meter).
            noisy[name_] = [bool(r.noisy or r.dry_steps or got["bulk", d, 0].noisy) for r in results]
    return PageCalibration(calibration_cache.device_key(device) + SUFFIX, list(PAGE_BYTES), alone, beside, over_bulk,
                           noisy, bulk_slowdown)


def page_calibration(device: int | None = None, recalibrate: bool = False) -> PageCalibration:
    """``device``'s page calibration, cached as kvoffload.costs.cache.cached() caches
    its own: in this process, else from the file, else measured now and saved."""
    return calibration_cache.cached(device, SUFFIX, PageCalibration, lambda d: measure(d), recalibrate)


def main(argv: list[str]) -> None:
    cal = page_calibration(calibration_cache.recalibrate_device(argv, "kvoffload.costs.page_calibration"), recalibrate=True)
    print(f"{cal.key}: written to {calibration_cache.path()}")
    print("bulk copies' slowdown: " + ", ".join(f"{d} {s:+.2%}" for d, s in cal.bulk_slowdown.items()))
    print(f"{'':<20}" + "".join(f"{b >> 10:>10} KiB{'':>15}" for b in cal.page_bytes))
    print("GB/s alone / beside @ step slowdown over bulk copies' (? where noisy)")
    for key in cal.beside:
        print(f"{key:<20}" + "".join(f"{a:5.1f} / {r:5.1f} @ {s:+.2%}{'?' if q else ' '}  " for a, r, s, q in
                                     zip(cal.alone[key], cal.beside[key], cal.over_bulk[key], cal.noisy[key])))


if __name__ == "__main__":
    main(sys.argv[1:])
