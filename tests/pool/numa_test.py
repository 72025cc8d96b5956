"""kvoffload.pool.numa: which CPUs first-touch a pool, and when it is bound to a node."""

import os

import pytest

from kvoffload import _C

from kvoffload.pool import numa
from proc_maps import numa_policy
from kvoffload.pool.memory import PoolMemory


def fake_sysfs(tmp_path, has_memory, cpulists):
    (tmp_path / "has_memory").write_text(has_memory + "\n")
    for node, cpus in cpulists.items():
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    return str(tmp_path)


def test_cpulists_parse():
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert numa.parse_cpulist("") == []


def test_an_unknown_node_uses_every_allowed_cpu_and_binds_nothing():
    assert numa.placement(None) == (sorted(os.sched_getaffinity(0)), None)
    assert numa.placement(-1) == (sorted(os.sched_getaffinity(0)), None)


def test_on_one_node_the_pool_is_not_bound(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    root = fake_sysfs(tmp_path, "0", {0: f"{allowed[0]}"})
    assert numa.placement(0, root) == ([allowed[0]], None)


def test_with_two_nodes_the_pool_is_bound_and_touched_by_the_nodes_cpus(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    root = fake_sysfs(tmp_path, "0-1", {0: "1000-1010", 1: ",".join(map(str, allowed[-1:]))})
    assert numa.placement(1, root) == (allowed[-1:], 1)
    # A node none of whose CPUs this process may use: every allowed CPU touches.
    assert numa.placement(0, root) == (allowed, 0)


def test_a_node_without_memory_is_refused(tmp_path):
    root = fake_sysfs(tmp_path, "0", {0: "0"})
    with pytest.raises(ValueError, match=r"numa_node: node 3 has no memory or does not exist"):
        numa.placement(3, root)


def test_prefer_node_sets_the_mappings_policy():
    memory = PoolMemory(4 << 20)
    assert numa_policy(memory.base) == "default"
    _C.pool_prefer_node(memory.base, memory.mapped_bytes, 0)
    assert numa_policy(memory.base) == "prefer:0"
    memory.close()


def test_prefer_node_checks_its_arguments():
    with pytest.raises(ValueError, match="node: must be in"):
        _C.pool_prefer_node(4096, 4096, 5000)
    with pytest.raises(ValueError, match="address: must be a positive multiple of 4096"):
        _C.pool_prefer_node(4097, 4096, 0)
