"""The memory of a host pool: an anonymous mapping or a shared file under /dev/shm,
sized exactly (rounded up to pages), with huge pages if asked; or, where the GPU cannot
register host memory, a cudaHostAlloc allocation.

The memory lives as long as its views: ``close()`` drops the pool's own, and the pages
are unmapped (or freed) then, or when the last view a caller still holds goes.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import warnings

import numpy as np

from .. import _C
from .shm_file import SHM_DIR, SharedFile

HUGE_PAGES = ("auto", "off", "thp", "hugetlb")
PAGE = 4096
HUGE_PAGE = 2 << 20
_MAP_HUGETLB = 0x40000  # <sys/mman.h>; Python's mmap module does not name it
_MADV_HUGEPAGE = 14
_THP = "/sys/kernel/mm/transparent_hugepage/"


class PinnedMemoryError(RuntimeError):
    """Host memory could not be had or page-locked; transfers would be slow or unsafe."""


def _mapped(nbytes: int, fd: int = -1, flags: int = mmap.MAP_PRIVATE) -> mmap.mmap:
    """mmap of the pool's ``nbytes``; where the kernel refuses the address space, an error
    that names the pool's size and the process's address-space limit."""
    try:
        return mmap.mmap(fd, nbytes, flags=flags)
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        limit = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
        raise PinnedMemoryError(f"could not map the host pool's {nbytes} bytes ({e.strerror}); this "
                                f"process's address-space limit (RLIMIT_AS, ulimit -v) is {limit}") from e


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def require_available(nbytes: int) -> None:
    """Raises PinnedMemoryError, before anything is touched, when the machine lacks the
    memory: touching it would wake the OOM killer instead of failing."""
    available = mem_available()
    if available is not None and nbytes > available:
        raise PinnedMemoryError(f"not enough memory: the pool needs {nbytes / 2**30:.2f} GiB, the "
                                f"machine has {available / 2**30:.2f} GiB available (MemAvailable)")


def _thp_mode(name: str) -> str:
    try:
        with open(_THP + name) as f:
            text = f.read()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return "never"


class PoolMemory:
    """``nbytes`` of host memory for a pool (``array``, ``base``, ``mapped_bytes``).

    shm_name: the pool is the file of that name under ``shm_dir``, shared with other
    processes (see kvoffload.pool.shm_file), ``shm_tag`` saying what it holds. huge_pages: "off", "thp" (madvise(MADV_HUGEPAGE)),
    or "hugetlb" (reserved 2 MiB pages; anonymous pools only), falling back to the next
    with a RuntimeWarning; "auto" is "thp" where the machine has transparent huge pages
    and "off" elsewhere, without a warning. host_alloc_device: allocate with cudaHostAlloc for this device
    instead (the pool is then pinned already).
    """

    def __init__(self, nbytes: int, shm_name: str | None = None, huge_pages: str = "off",
                 host_alloc_device: int | None = None, shm_dir: str = SHM_DIR, shm_tag: str = ""):
        if huge_pages not in HUGE_PAGES:
            raise ValueError(f"huge_pages: expected one of {HUGE_PAGES}, got {huge_pages!r}")
        if huge_pages == "hugetlb" and shm_name is not None:
            raise ValueError("huge_pages: 'hugetlb' is for anonymous pools; a shared pool (shm_name) "
                             "takes 'thp'")
        self.nbytes = nbytes
        self.huge_pages = huge_pages
        self.shared_file: SharedFile | None = None
        self.host_alloc_device = host_alloc_device
        self._mmap = None
        if host_alloc_device is not None:
            if shm_name is not None:
                raise PinnedMemoryError("shm_name: a shared pool needs cudaHostRegister, which this "
                                        "GPU does not support")
            self.mapped_bytes = round_up(nbytes, PAGE)
            self._array = _host_alloc_array(self.mapped_bytes, host_alloc_device)
        else:
            self._array = self._map(shm_name, shm_dir, shm_tag)
        self.base = self._array.ctypes.data

    @property
    def array(self) -> np.ndarray:
        return self._array[:self.nbytes]

    def _map(self, shm_name, shm_dir, shm_tag) -> np.ndarray:
        if self.huge_pages == "hugetlb":
            self.mapped_bytes = round_up(self.nbytes, HUGE_PAGE)
            require_available(self.mapped_bytes)
            try:
                self._mmap = mmap.mmap(-1, self.mapped_bytes, flags=mmap.MAP_PRIVATE | _MAP_HUGETLB)
                return np.frombuffer(self._mmap, np.uint8)
            except OSError as e:
                warnings.warn(f"huge_pages='hugetlb': no {self.mapped_bytes} bytes of reserved huge "
                              f"pages ({e}); using transparent huge pages", RuntimeWarning, stacklevel=4)
                self.huge_pages = "thp"
        self.mapped_bytes = round_up(self.nbytes, PAGE)
        if shm_name is None:
            require_available(self.mapped_bytes)
            self._mmap = _mapped(self.mapped_bytes)
        else:
            self.shared_file = SharedFile(shm_name, self.mapped_bytes, shm_dir, shm_tag)
            try:
                if self.shared_file.created:
                    require_available(self.mapped_bytes)
                self._mmap = _mapped(self.mapped_bytes, self.shared_file.fd, mmap.MAP_SHARED)
            except BaseException:
                self.shared_file.close()
                raise
        if self.huge_pages in ("thp", "auto"):
            self._advise_huge_pages(warn=self.huge_pages == "thp")
        return np.frombuffer(self._mmap, np.uint8)

    def _advise_huge_pages(self, warn: bool) -> None:
        """Sets huge_pages to "thp", or to "off" (with a warning if ``warn``) where the
        machine or the kernel refuses them."""
        mode = _thp_mode("enabled" if self.shared_file is None else "shmem_enabled")
        why = None
        if mode in ("never", "deny"):
            why = f"transparent huge pages are '{mode}' on this machine ({_THP})"
        else:
            try:
                self._mmap.madvise(_MADV_HUGEPAGE)
            except OSError as e:
                why = f"madvise(MADV_HUGEPAGE) failed ({e})"
        self.huge_pages = "off" if why else "thp"
        if why and warn:
            warnings.warn(f"huge_pages='thp': {why}; using 4 KiB pages", RuntimeWarning, stacklevel=5)

    def close(self) -> bool:
        """Drops the pool's view of its memory and leaves a shared file; returns whether this
        process removed the file. Idempotent."""
        self._array = np.zeros(0, np.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # views are still alive; the mapping goes with the last of them
            self._mmap = None
        removed = self.shared_file.close() if self.shared_file is not None else False
        return removed


class _HostAllocation:
    """cudaHostAlloc memory, freed when the last array over it goes."""

    def __init__(self, nbytes: int, device: int):
        self.device = device
        self.pid = os.getpid()
        self.address = _C.pool_host_alloc(nbytes, device)
        self.__array_interface__ = dict(shape=(nbytes,), typestr="|u1", version=3,
                                        data=(self.address, False))

    def __del__(self):
        if os.getpid() == self.pid:  # a forked child's copy is the parent's to free
            _C.pool_free_host(self.address, self.device)


def _host_alloc_array(nbytes: int, device: int) -> np.ndarray:
    try:
        return np.asarray(_HostAllocation(nbytes, device))
    except _C.CudaError as e:
        raise PinnedMemoryError(f"could not allocate {nbytes} bytes with cudaHostAlloc: {e}") from e
