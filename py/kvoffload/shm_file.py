"""A named file under /dev/shm that several processes map as one host pool, as tensor-
parallel ranks share one offload region: the first process creates it, the others
attach, the last one out removes it.

Every process holds a shared flock on the file while attached; the one that can turn
its lock exclusive on leaving is the last and removes the file. The kernel drops the
locks of a process that dies, so a crash never blocks the others. A file is created
under a temporary name, sized, locked, and then linked to its name, so no process ever
attaches to a file not yet sized.
"""

from __future__ import annotations

import errno
import fcntl
import os
import uuid

SHM_DIR = "/dev/shm"


class SharedFile:
    """The file ``name`` in ``directory``, ``nbytes`` long, open and locked (shared).

    ``created`` says whether this process made it. ``close()`` returns whether it
    removed it.
    """

    def __init__(self, name: str, nbytes: int, directory: str = SHM_DIR):
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise ValueError(f"shm_name: expected a file name without '/', got {name!r}")
        self.path = os.path.join(directory, name)
        self.nbytes = nbytes
        self.created = False
        self.fd = -1
        for _ in range(100):
            if self._attach() or self._create():
                return
        raise RuntimeError(f"shm_name: {self.path} kept being created and removed by other "
                           f"processes; gave up after 100 tries")

    def _attach(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            linked, size = self._is_linked(fd), os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        if not linked:  # the last one out removed it while we opened it
            os.close(fd)
            return False
        if size != self.nbytes:
            os.close(fd)
            raise ValueError(f"shm_name: {self.path} holds {size} bytes, this pool needs "
                             f"{self.nbytes}")
        self.fd = fd
        return True

    def _create(self) -> bool:
        directory = os.path.dirname(self.path)
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        if free < self.nbytes:
            raise OSError(errno.ENOSPC, f"{directory} has {free} bytes free, the pool needs "
                          f"{self.nbytes}", self.path)
        temporary = os.path.join(directory, f".{os.path.basename(self.path)}.{uuid.uuid4().hex}")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.link(temporary, self.path)
        except FileExistsError:
            os.close(fd)
            return False  # another process created it first: attach to theirs
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(temporary)
        self.fd, self.created = fd, True
        return True

    def _is_linked(self, fd: int) -> bool:
        """Whether the open file is still the one under our name."""
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)

    def close(self) -> bool:
        """Leaves the file, removing it if no other process is attached. Idempotent."""
        if self.fd < 0:
            return False
        removed = False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if self._is_linked(self.fd):
                os.unlink(self.path)
                removed = True
        except BlockingIOError:
            pass  # others are still attached
        finally:
            os.close(self.fd)
            self.fd = -1
        return removed

