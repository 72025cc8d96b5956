"""Where a host pool's registrations end: on page boundaries that cut no chunk, so no KV
page spans two registrations (the driver's batch copy rejects such a page); and copies
cut at those edges where a coalesced run crosses one."""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

PAGE = 4096


@dataclasses.dataclass(frozen=True)
class ChunkRun:
    """Bytes [start, end) of a pool hold whole chunks of ``chunk_bytes`` (a chunk, or a
    tensor's slot in each chunk) that no edge may cut."""

    start: int
    chunk_bytes: int
    end: int


class _Runs:
    def __init__(self, runs):
        self.runs = sorted((r for r in runs if r.chunk_bytes > 0 and r.end > r.start), key=lambda r: r.start)
        self.starts = [r.start for r in self.runs]

    def cutting(self, at: int) -> ChunkRun | None:
        """The run that has ``at`` strictly inside it."""
        i = bisect.bisect_left(self.starts, at) - 1
        if i >= 0 and self.runs[i].start < at < self.runs[i].end:
            return self.runs[i]
        return None

    def floor_edge(self, at: int, low: int) -> int | None:
        """The largest edge in (low, at], or None."""
        at -= at % PAGE
        while at > low:
            run = self.cutting(at)
            if run is None:
                return at
            chunk_edge = at - (at - run.start) % run.chunk_bytes
            if chunk_edge == at:
                return at
            at = chunk_edge - chunk_edge % PAGE
        return None

    def ceil_edge(self, at: int, high: int) -> int:
        """The smallest edge in [at, high], ``high`` if none is smaller."""
        at = -(-at // PAGE) * PAGE
        while at < high:
            run = self.cutting(at)
            if run is None:
                return at
            chunk_edge = at + (-(at - run.start)) % run.chunk_bytes
            if chunk_edge == at:
                return at
            at = -(-chunk_edge // PAGE) * PAGE
        return high


def registration_ends(nbytes: int, runs, registration_bytes: int) -> list[int]:
    """The end offsets of the registrations a pool of ``nbytes`` (a multiple of PAGE) is
    registered in: each at most ``registration_bytes`` where an edge allows, else the
    smallest that does."""
    if registration_bytes < PAGE:
        raise ValueError(f"registration_bytes: must be >= {PAGE}, got {registration_bytes}")
    edges, ends, at = _Runs(runs), [], 0
    while at < nbytes:
        target = at + registration_bytes
        if target >= nbytes:
            end = nbytes
        else:
            end = edges.floor_edge(target, at) or edges.ceil_edge(target, nbytes)
        ends.append(end)
        at = end
    return ends


def split_at(edges: np.ndarray, host: np.ndarray, other: np.ndarray, sizes: np.ndarray):
    """(host, other, sizes) with every copy that crosses one of ``edges`` (sorted host
    addresses) cut there; the arrays themselves when none does."""
    ends = host + sizes
    first = np.searchsorted(edges, host, side="right")
    cuts = np.searchsorted(edges, ends, side="left") - first
    if not cuts.any():
        return host, other, sizes
    spans = cuts + 1
    copy = np.repeat(np.arange(len(sizes)), spans)
    k = np.arange(len(copy)) - np.repeat(np.cumsum(spans) - spans, spans)
    edge = first[copy] + k
    start = np.where(k == 0, host[copy], edges[np.maximum(edge - 1, 0)])
    end = np.where(k == spans[copy] - 1, ends[copy], edges[np.minimum(edge, len(edges) - 1)])
    return start, other[copy] + (start - host[copy]), end - start
