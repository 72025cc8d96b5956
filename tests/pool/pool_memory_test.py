"""kvoffload.pool.memory: exact sizes, huge pages with their fallbacks, unmapping, and
refusing what the machine cannot give."""

import errno
import os
import uuid
import warnings

import numpy as np
import pytest

from kvoffload.pool import memory as pool_memory
from kvoffload.pool.memory import PinnedMemoryError, PoolMemory
from proc_maps import mapping


def thp_mode(name):
    text = open(f"/sys/kernel/mm/transparent_hugepage/{name}").read()
    return text[text.index("[") + 1:text.index("]")]


@pytest.mark.parametrize("nbytes", [1, 4096, (5 << 20) + 7])
def test_an_anonymous_pool_is_mapped_rounded_up_to_pages_and_untouched(nbytes):
    memory = PoolMemory(nbytes)
    pages = -(-nbytes // 4096)
    assert memory.mapped_bytes == pages * 4096 and memory.array.size == nbytes
    start, end = mapping(memory.base)["range"]  # the kernel may merge it with a neighbour
    assert start <= memory.base and memory.base + memory.mapped_bytes <= end
    assert memory.close() is False
    assert mapping(memory.base) is None


def test_close_unmaps_when_the_last_view_goes():
    memory = PoolMemory(1 << 20)
    view = memory.array[100:200]
    memory.close()
    assert mapping(memory.base) is not None
    view[:] = 7  # still valid memory
    del view
    assert mapping(memory.base) is None


def test_transparent_huge_pages_are_advised_or_a_warning_says_why_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memory = PoolMemory(8 << 20, huge_pages="thp")
    if thp_mode("enabled") == "never":
        assert memory.huge_pages == "off" and "transparent huge pages are 'never'" in str(caught[0].message)
    else:
        assert memory.huge_pages == "thp" and not caught
        assert "hg" in mapping(memory.base)["VmFlags"].split()
    memory.close()


@pytest.mark.parametrize("mode", ["always", "madvise", "never", "deny"])
def test_auto_huge_pages_follow_the_machine_without_a_warning(monkeypatch, mode):
    if mode in ("always", "madvise") and thp_mode("enabled") == "never":
        pytest.skip("this machine has no transparent huge pages")
    monkeypatch.setattr(pool_memory, "_thp_mode", lambda name: mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memory = PoolMemory(8 << 20, huge_pages="auto")
    flags = mapping(memory.base)["VmFlags"].split()
    if mode in ("never", "deny"):
        assert memory.huge_pages == "off" and "hg" not in flags
    else:
        assert memory.huge_pages == "thp" and "hg" in flags
    memory.close()


def test_hugetlb_without_reserved_pages_falls_back_with_a_warning():
    reserved = int(open("/proc/sys/vm/nr_hugepages").read())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memory = PoolMemory(3 << 20, huge_pages="hugetlb")
    if reserved >= 2:
        assert memory.huge_pages == "hugetlb" and memory.mapped_bytes == 4 << 20
    else:
        assert "huge_pages='hugetlb': no 4194304 bytes of reserved huge pages" in str(caught[0].message)
        assert memory.huge_pages in ("thp", "off") and memory.mapped_bytes == 3 << 20
    memory.close()


def test_more_than_the_machine_has_is_refused_before_mapping(monkeypatch):
    maps_before = open("/proc/self/maps").read().count("\n")
    monkeypatch.setattr(pool_memory, "mem_available", lambda: 1 << 30)
    with pytest.raises(PinnedMemoryError, match=r"not enough memory: the pool needs 2.00 GiB, the "
                                                r"machine has 1.00 GiB available"):
        PoolMemory(2 << 30)
    assert open("/proc/self/maps").read().count("\n") <= maps_before


def test_mem_available_reads_meminfo():
    assert 0 < pool_memory.mem_available() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_a_shared_pool_larger_than_dev_shm_is_refused_and_leaves_no_file():
    name = f"kvoffload-test-{uuid.uuid4().hex}"
    stat = os.statvfs("/dev/shm")
    too_big = stat.f_bavail * stat.f_frsize + (1 << 30)
    with pytest.raises(OSError) as raised:
        PoolMemory(too_big, shm_name=name)
    assert raised.value.errno == errno.ENOSPC and "the pool needs" in str(raised.value)
    assert not [f for f in os.listdir("/dev/shm") if name in f]


@pytest.mark.parametrize("kwargs, message", [
    (dict(huge_pages="2M"), r"huge_pages: expected one of \('auto', 'off', 'thp', 'hugetlb'\)"),
    (dict(huge_pages="hugetlb", shm_name="x"), r"huge_pages: 'hugetlb' is for anonymous pools"),
    (dict(shm_name="a/b"), r"shm_name: expected a file name without '/'"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolMemory(4096, **kwargs)


def test_a_shared_pool_is_the_named_file():
    name = f"kvoffload-test-{uuid.uuid4().hex}"
    memory = PoolMemory(10000, shm_name=name)
    assert memory.shared_file.created and os.path.getsize(f"/dev/shm/{name}") == 12288
    memory.array[:] = np.arange(10000) % 251
    with open(f"/dev/shm/{name}", "rb") as f:
        assert f.read(10000) == memory.array.tobytes()
    assert memory.close() and not os.path.exists(f"/dev/shm/{name}")


_UNDER_RLIMIT_AS = """
import resource
from kvoffload.pool.memory import PinnedMemoryError, PoolMemory
vm_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
limit = (vm_kib << 10) + (64 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    PoolMemory(1 << 30)
    print("mapped")
except PinnedMemoryError as e:
    print("refused" if "1073741824 bytes" in str(e) and f"RLIMIT_AS, ulimit -v) is {limit} bytes" in str(e) else e)
"""


def test_a_pool_past_the_address_space_limit_names_its_size_and_the_limit():
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", _UNDER_RLIMIT_AS], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["refused"], run.stdout
