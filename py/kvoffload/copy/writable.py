"""Whether host memory may be written: the process's mappings (/proc/self/maps) must
cover a range with writable ones. A read-only mapping (a file mapped read-only) given
as a pool or as a CPU cache would fault when a job writes it, which no copy could report."""

from __future__ import annotations

from typing import Iterable


def require_writable(spans: Iterable[tuple[str, int, int]]) -> None:
    """Raises ValueError naming the first of ``spans`` (name, address, bytes) that does not
    lie in writable mappings of this process (nothing is checked where /proc cannot be read)."""
    spans = [span for span in spans if span[2] > 0]
    maps = _mappings() if spans else None
    for name, address, nbytes in spans if maps is not None else ():
        if _first_unwritable(maps, address, nbytes) is None:
            continue
        maps = _mappings() or []  # read again: lines may be missed while mappings change
        at = _first_unwritable(maps, address, nbytes)
        if at is not None:
            raise ValueError(f"{name}: bytes [{at:#x}, {address + nbytes:#x}) are not writable memory of this "
                             "process (a read-only mapping?); a job writing them would fault")


def is_writable(address: int, nbytes: int) -> bool:
    """Whether [address, address + nbytes) lies in writable mappings of this process
    (True where /proc cannot be read)."""
    maps = _mappings()
    if maps is None or _first_unwritable(maps, address, nbytes) is None:
        return True
    maps = _mappings() or []  # read again: lines may be missed while mappings change
    return _first_unwritable(maps, address, nbytes) is None


def _mappings() -> list[tuple[int, int, bool]] | None:
    """(first address, end, writable) of every mapping, in address order."""
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        span, perms = line.split(maxsplit=2)[:2]
        lo, hi = span.split(b"-")
        out.append((int(lo, 16), int(hi, 16), perms[1:2] == b"w"))
    return out


def _first_unwritable(maps, address: int, nbytes: int) -> int | None:
    at, end = address, address + nbytes
    for lo, hi, writable in maps:
        if hi <= at:
            continue
        if lo > at or not writable:
            return at
        at = hi
        if at >= end:
            return None
    return at
