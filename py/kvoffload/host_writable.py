"""Whether host memory may be written: the process's mappings (/proc/self/maps) must
cover the range with writable ones. A read-only mapping (a file mapped read-only) given
as a pool or as a CPU cache would fault when a job writes it, which no copy could report."""

from __future__ import annotations


def require_writable(name: str, address: int, nbytes: int) -> None:
    """Raises ValueError naming ``name`` unless [address, address + nbytes) lies in
    writable mappings of this process (unchecked where /proc cannot be read)."""
    if nbytes <= 0:
        return
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read().splitlines()
    except OSError:
        return
    at, end = address, address + nbytes
    for line in maps:  # in address order
        span, perms = line.split(maxsplit=2)[:2]
        lo, hi = (int(x, 16) for x in span.split(b"-"))
        if hi <= at:
            continue
        if lo > at or perms[1:2] != b"w":
            break
        at = hi
        if at >= end:
            return
    raise ValueError(f"{name}: bytes [{at:#x}, {end:#x}) are not writable memory of this process "
                     "(a read-only mapping?); a job writing them would fault")
