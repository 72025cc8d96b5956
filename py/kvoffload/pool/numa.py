"""Where a host pool's pages go: the CPUs that first-touch them and the NUMA node they
are bound to, read from sysfs."""

from __future__ import annotations

import os

NODE_ROOT = "/sys/devices/system/node"


def parse_cpulist(text: str) -> list[int]:
    """CPUs of a sysfs list such as "0-3,8,10-11"."""
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def _read_list(path: str) -> list[int] | None:
    try:
        with open(path) as f:
            return parse_cpulist(f.read())
    except OSError:
        return None


def memory_nodes(root: str = NODE_ROOT) -> list[int]:
    """The NUMA nodes that have memory ([0] where sysfs does not say)."""
    return _read_list(os.path.join(root, "has_memory")) or [0]


def placement(node: int | None, root: str = NODE_ROOT) -> tuple[list[int], int | None]:
    """(CPUs to first-touch with, node to bind the pool to or None) for NUMA node ``node``
    (None or -1: unknown). The CPUs are those of the node that this process may run on,
    or all it may run on; the pool is bound only where the machine has several nodes."""
    allowed = sorted(os.sched_getaffinity(0))
    if node is None or node < 0:
        return allowed, None
    nodes = memory_nodes(root)
    if node not in nodes:
        raise ValueError(f"numa_node: node {node} has no memory or does not exist (nodes with "
                         f"memory: {nodes})")
    on_node = set(_read_list(os.path.join(root, f"node{node}", "cpulist")) or ())
    cpus = [c for c in allowed if c in on_node] or allowed
    return cpus, node if len(nodes) > 1 else None
