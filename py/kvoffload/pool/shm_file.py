"""A named file under /dev/shm that several processes map as one host pool, as tensor-
parallel ranks share one offload region: the first process creates it, the others
attach, the last one out removes it.

Every process holds a shared flock on the file while attached; the one that can turn
its lock exclusive on leaving is the last and removes the file. The kernel drops the
locks of a process that dies, so a crash never blocks the others. A file is created
under a temporary name, locked, sized, and then linked to its name, so no process ever
attaches to a file not yet sized, and a file no one holds is a dead process's
(``remove_leftovers``).

/dev/shm is shared by every user of the machine, so a file found under the name is
attached only if it is a regular file (not a symbolic link: opened with O_NOFOLLOW), of
this user, with mode 0600 at most: another user could otherwise plant one beforehand and
read or write the pool's bytes. New files are made with mode 0600. Where the name comes
from something others can guess, ``unguessable_name`` adds a secret suffix.

A forked child inherits the open file and with it the lock (flock locks belong to the
open file, which parent and child share): a SharedFile in a process other than the one
that attached it only closes its copy of the descriptor, and never unlocks or removes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
from typing import Callable

SHM_DIR = "/dev/shm"
NAME_MAX = 255  # bytes of one file name (Linux)
_SECRET_HEX = 32  # 128 bits
TAG_BYTES = 4096  # after the pool's bytes: what the pool holds (SharedFile's tag)
TEMPORARY_PREFIX = ".kvoffload-"  # a file being made, before it has its name


def check_name(name, field: str = "shm_name") -> str:
    """``name`` if it is a valid file name for a shared pool, else ValueError naming ``field``."""
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{field}: expected a file name without '/', got {name!r}")
    if "\0" in name:
        raise ValueError(f"{field}: must not contain a NUL byte, got {name!r}")
    try:
        size = len(os.fsencode(name))
    except UnicodeError as e:
        raise ValueError(f"{field}: {name!r} cannot be a file name ({e})") from None
    if size > NAME_MAX:
        raise ValueError(f"{field}: a file name is at most {NAME_MAX} bytes, got {size}")
    return name


def unguessable_name(prefix: str, share: Callable[[str], str] | None = None) -> str:
    """``prefix`` and a secret random suffix: a name no other user can plant a file under
    before the pool is made (it can list /dev/shm only once the file exists, mode 0600).

    Processes that must share one pool call this together, each with ``share``: it takes
    this process's candidate and returns the one of the process that decides (rank 0),
    e.g. ``lambda name: group.broadcast_object(name, src=0)``. Without ``share`` the name
    is this process's own.
    """
    check_name(prefix, "prefix")
    if len(os.fsencode(prefix)) > NAME_MAX - 1 - _SECRET_HEX:
        raise ValueError(f"prefix: at most {NAME_MAX - 1 - _SECRET_HEX} bytes, leaving room for "
                         f"the secret suffix; got {prefix!r}")
    name = f"{prefix}-{secrets.token_hex(_SECRET_HEX // 2)}"
    if share is not None:
        name = share(name)
        if not (isinstance(name, str) and name.startswith(prefix + "-")
                and re.fullmatch(rf"[0-9a-f]{{{_SECRET_HEX}}}", name[len(prefix) + 1:])):
            raise ValueError(f"share: expected {prefix!r} and a {_SECRET_HEX}-digit secret, as "
                             f"unguessable_name makes, got {name!r}")
    return name


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return what
    return "not a regular file"


def planted(st: os.stat_result) -> str | None:
    """Why a file with these stats is not one to share KV bytes through (another user
    could have planted it or could read it), or None: a regular file of this user, mode
    0600 or narrower."""
    if not stat.S_ISREG(st.st_mode):
        return f"is {_kind(st.st_mode)}, not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & ~0o600:
        return f"has mode {mode:04o}, wider than 0600 (other users could read or write it)"
    return None


def _is_named(path: str, fd: int) -> bool:
    """Whether the open file is still the one under ``path``."""
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)


class SharedFile:
    """The file ``name`` in ``directory``, ``nbytes`` long, open and locked (shared).

    ``tag``: what the pool holds (its layout), at most TAG_BYTES of text kept after the
    ``nbytes`` in a file this process makes; attaching to a file whose tag differs is
    refused, naming both, as two pools of different layouts under one name would read
    each other's bytes as their own. ``created`` says whether this process made it.
    ``close()`` returns whether it removed it.
    """

    def __init__(self, name: str, nbytes: int, directory: str = SHM_DIR, tag: str = ""):
        check_name(name)
        self.path = os.path.join(directory, name)
        self.nbytes = nbytes
        self.tag = tag.encode()
        if len(self.tag) > TAG_BYTES:
            raise ValueError(f"tag: at most {TAG_BYTES} bytes, got {len(self.tag)}")
        self.created = False
        self.fd = -1
        self.pid = os.getpid()  # the process whose lock this is
        for _ in range(100):
            if self._attach() or self._create():
                return
        raise RuntimeError(f"shm_name: {self.path} kept being created and removed by other "
                           f"processes; gave up after 100 tries")

    def _refuse(self, why: str) -> PermissionError:
        return PermissionError(errno.EPERM, f"shm_name: {self.path} {why}; refusing to attach a "
                                            "pool file that another user could have planted", self.path)

    def _open_existing(self) -> int | None:
        """The file under our name, opened read-write, if it is one this user may attach
        to; None if there is none. O_NONBLOCK: opening a planted FIFO must not block."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            try:
                found = os.lstat(self.path)
            except OSError:
                raise e from None
            self._check(found)  # says why, where the file is not one to attach to
            raise
        try:
            self._check(os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check(self, st: os.stat_result) -> None:
        why = planted(st)
        if why is not None:
            raise self._refuse(why)

    def _attach(self) -> bool:
        fd = self._open_existing()
        if fd is None:
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
        want = self.nbytes + (TAG_BYTES if self.tag else 0)
        if size != want:
            os.close(fd)
            raise ValueError(f"shm_name: {self.path} holds {size} bytes, this pool needs {want}")
        if self.tag:
            theirs = os.pread(fd, TAG_BYTES, self.nbytes).rstrip(b"\0")
            if theirs != self.tag:
                os.close(fd)
                raise ValueError(f"shm_name: {self.path} holds another pool ({theirs.decode(errors='replace')}); "
                                 f"this one is {self.tag.decode()}: two pools under one name would read "
                                 "each other's bytes")
        self.fd = fd
        return True

    def _create(self) -> bool:
        directory = os.path.dirname(self.path)
        stat_fs = os.statvfs(directory)
        free = stat_fs.f_bavail * stat_fs.f_frsize
        if free < self.nbytes + TAG_BYTES:
            raise OSError(errno.ENOSPC, f"{directory} has {free} bytes free, the pool needs "
                          f"{self.nbytes}", self.path)
        # Not derived from the name, which may be as long as a name can be.
        temporary = os.path.join(directory, f"{TEMPORARY_PREFIX}{secrets.token_hex(16)}.tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # from the start: remove_leftovers leaves held files
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, self.nbytes + (TAG_BYTES if self.tag else 0))
            if self.tag:
                os.pwrite(fd, self.tag, self.nbytes)
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
        return _is_named(self.path, fd)

    def unlink(self) -> bool:
        """Removes the file's name, if it is still this file's, once every process that
        shares it has mapped it: the mappings stay, and a process that dies leaves nothing
        in the directory. Returns whether it removed it."""
        if self.fd < 0 or not self._is_linked(self.fd):
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> bool:
        """Leaves the file, removing it if no other process is attached. Idempotent. In a
        forked child only closes the child's descriptor: the lock is the parent's."""
        if self.fd < 0:
            return False
        removed = False
        try:
            if os.getpid() != self.pid:
                return False
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


def remove_leftovers(prefix: str, directory: str = SHM_DIR) -> list[str]:
    """Removes the files under ``prefix`` that processes which died left: this user's
    (mode 0600 at most), held by no one. A live process holds its shared file's lock
    from before the file has its name until it leaves, so a named file no one holds is
    a dead one's. Files of other users and files in use are left alone. Returns the
    names removed."""
    check_name(prefix, "prefix")
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone, a symbolic link, or not ours to open
        try:
            st = os.fstat(fd)
            if planted(st) is not None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use
            if _is_named(path, fd):
                os.unlink(path)
                removed.append(name)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed

