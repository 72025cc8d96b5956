"""What the kernel says about this process's mappings (/proc/self/smaps, numa_maps)."""

from __future__ import annotations


def mapping(address: int) -> dict[str, str] | None:
    """The smaps fields (e.g. "Size", "Rss", in kB with their unit) of the mapping that
    holds ``address``, plus "range" (start, end); None if nothing is mapped there."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                if found is not None:
                    return found
                start, end = (int(x, 16) for x in head[0].split("-"))
                if start <= address < end:
                    found = {"range": (start, end)}
            elif found is not None:
                key, _, value = line.partition(":")
                found[key] = value.strip()
    return found


def kib(field: str) -> int:
    """A smaps size field ("123 kB") in KiB."""
    number, unit = field.split()
    assert unit == "kB", field
    return int(number)


def numa_policy(address: int) -> str | None:
    """The NUMA policy of the mapping at ``address`` (numa_maps), or None."""
    with open("/proc/self/numa_maps") as f:
        for line in f:
            start, policy = line.split()[:2]
            if int(start, 16) == address:
                return policy
    return None
