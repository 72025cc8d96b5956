"""kvoffload.pool.shm_file and shared pools across processes: one creates the file, the others
attach to it and see the same bytes, the last one out removes it, even after a crash."""

import multiprocessing
import os
import stat
import uuid

import numpy as np
import pytest

from hostile import another_uid
from kvoffload.pool.host_pool import HostPool, PoolOptions
from kvoffload.pool.shm_file import SharedFile, remove_leftovers, unguessable_name

NBYTES = (3 << 20) + 100
CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def name():
    name = f"kvoffload-test-{uuid.uuid4().hex}"
    yield name
    assert not os.path.exists(f"/dev/shm/{name}"), "a test left its file behind"


def pool(name):
    return HostPool(NBYTES, pinned=False, options=PoolOptions(shm_name=name))


def attach_write_and_leave(name, value, crash, conn):
    """In a child: attach, report what the pool holds, write ``value`` to it, leave."""
    p = pool(name)
    conn.send((p.memory.shared_file.created, int(p.array[0]), int(p.array[-1])))
    p.array[:] = value
    if crash:
        os._exit(0)
    conn.send(p.memory.close())
    p.release()


def run_child(name, value, crash=False):
    parent, child = CTX.Pipe()
    process = CTX.Process(target=attach_write_and_leave, args=(name, value, crash, child))
    process.start()
    created, first, last = parent.recv()
    removed = None if crash else parent.recv()
    process.join()
    assert process.exitcode == 0
    return created, first, last, removed


def test_processes_share_the_pool_and_the_last_one_out_removes_it(name):
    p = pool(name)
    assert p.memory.shared_file.created and p.ready()
    p.array[:] = 5
    assert run_child(name, 9) == (False, 5, 5, False)  # attached, saw our bytes, left it
    assert (p.array == 9).all() and p.array.size == NBYTES
    assert os.path.exists(f"/dev/shm/{name}")
    p.release()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_child_that_creates_and_leaves_last_removes_the_file(name):
    assert run_child(name, 1) == (True, 0, 0, True)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_crashed_process_does_not_keep_the_file_alive(name):
    p = pool(name)
    run_child(name, 3, crash=True)
    assert (p.array == 3).all()
    p.release()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_stale_file_nobody_holds_is_attached_and_then_removed(name):
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, -(-NBYTES // 4096) * 4096)
    os.close(fd)
    p = pool(name)
    assert not p.memory.shared_file.created
    p.release()


def test_attaching_with_another_size_is_refused(name):
    p = pool(name)
    with pytest.raises(ValueError, match=rf"shm_name: /dev/shm/{name} holds 3149824 bytes, this pool needs 4096"):
        HostPool(10, pinned=False, options=PoolOptions(shm_name=name))
    p.release()


def test_leaving_twice_is_harmless(name):
    shared = SharedFile(name, 4096)
    assert shared.close() is True and shared.close() is False


def test_release_leaves_no_file_even_while_a_view_is_alive(name):
    p = pool(name)
    view = p.array[:10]
    p.release()
    assert not os.path.exists(f"/dev/shm/{name}")
    view[:] = 1
    assert (np.asarray(view) == 1).all()


MAPPED = -(-NBYTES // 4096) * 4096


def plant(path, mode=0o600, uid=None, fill=b"\x55"):
    """A file of the pool's size at ``path``, as another user would leave it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, fill * MAPPED)
    os.fchmod(fd, mode)
    if uid is not None:
        os.fchown(fd, uid, -1)
    os.close(fd)


def refused(name, message):
    """Attaching to ``name`` raises PermissionError with ``message`` and leaves it alone."""
    with pytest.raises(PermissionError, match=rf"shm_name: /dev/shm/{name} {message}; refusing to "
                                              r"attach a pool file that another user could have planted"):
        pool(name)


def test_new_files_are_this_users_with_mode_0600_whatever_the_umask(name):
    old = os.umask(0)
    try:
        p = pool(name)
    finally:
        os.umask(old)
    st = os.stat(f"/dev/shm/{name}")
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    p.release()


def test_a_file_another_user_planted_is_refused(name, monkeypatch):
    path = f"/dev/shm/{name}"
    uid = another_uid()
    plant(path, uid=uid)
    me = os.geteuid()
    if uid is None:  # no other uid to give it to: this process becomes another user instead
        uid, me = me, me + 4242
        monkeypatch.setattr(os, "geteuid", lambda: me)
    try:
        refused(name, rf"is owned by uid {uid}, not by this user \(uid {me}\)")
        with open(path, "rb") as f:
            assert f.read() == b"\x55" * MAPPED
    finally:
        os.unlink(path)


@pytest.mark.parametrize("mode", [0o666, 0o640, 0o604, 0o4600])
def test_a_file_others_may_read_or_write_is_refused(name, mode):
    path = f"/dev/shm/{name}"
    plant(path, mode)
    try:
        refused(name, rf"has mode {mode:04o}, wider than 0600 \(other users could read or write it\)")
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
    finally:
        os.unlink(path)


def test_a_planted_symlink_is_refused_and_its_target_left_intact(name, tmp_path):
    target = tmp_path / "precious"
    plant(str(target))  # of the pool's size, this user's, mode 0600: all it takes but a link
    os.symlink(target, f"/dev/shm/{name}")
    try:
        refused(name, r"is a symbolic link, not a regular file")
        assert target.read_bytes() == b"\x55" * MAPPED
    finally:
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("kind", ["a FIFO", "a directory"])
def test_a_planted_fifo_or_directory_is_refused(name, kind):
    path = f"/dev/shm/{name}"
    (os.mkfifo if kind == "a FIFO" else os.mkdir)(path, 0o600)
    try:
        refused(name, rf"is {kind}, not a regular file")
    finally:
        (os.unlink if kind == "a FIFO" else os.rmdir)(path)


def test_a_name_with_a_nul_byte_is_named():
    with pytest.raises(ValueError, match=r"shm_name: must not contain a NUL byte, got 'a\\x00b'"):
        PoolOptions(shm_name="a\0b")
    with pytest.raises(ValueError, match=r"shm_name: must not contain a NUL byte"):
        SharedFile("a\0b", 4096)


def test_a_name_as_long_as_a_name_can_be_works_and_a_longer_one_is_named():
    long = f"kvoffload-test-{uuid.uuid4().hex}".ljust(230, "x")
    p = pool(long)
    assert p.memory.shared_file.created and os.path.exists(f"/dev/shm/{long}")
    p.release()
    assert not os.path.exists(f"/dev/shm/{long}")
    longest = long.ljust(255, "y")
    SharedFile(longest, 4096).close()
    assert not os.path.exists(f"/dev/shm/{longest}")
    with pytest.raises(ValueError, match=r"shm_name: a file name is at most 255 bytes, got 256"):
        PoolOptions(shm_name=longest + "z")


def fork_and_release(p):
    """In a forked child: leave the pool as a child's exit does; the exit status says
    whether it kept its hands off the file (0)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            removed = p.memory.close()
            p.release()
            code = 0 if removed is False else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child removed the parent's file"


def test_a_forked_childs_leaving_neither_removes_the_file_nor_drops_the_parents_lock(name):
    p = pool(name)
    p.array[:] = 5
    fork_and_release(p)
    assert os.path.exists(f"/dev/shm/{name}")
    # Another process attaches to our file and, as we are still attached, leaves it.
    assert run_child(name, 9) == (False, 5, 5, False)
    assert (p.array == 9).all()
    p.release()
    assert not os.path.exists(f"/dev/shm/{name}")


def attach_and_hold(name, conn):
    p = pool(name)
    conn.send(int(p.array[0]))
    conn.recv()
    conn.send(p.memory.close())
    p.release()


def test_after_a_forked_child_leaves_the_next_rank_to_leave_does_not_remove_the_parents_file(name):
    p = pool(name)
    p.array[:] = 4
    parent, child = CTX.Pipe()
    holder = CTX.Process(target=attach_and_hold, args=(name, child))
    holder.start()
    assert parent.recv() == 4  # attached
    fork_and_release(p)  # the child's try at the exclusive lock must not drop ours
    parent.send("leave")
    assert parent.recv() is False  # the holder left, we are still attached: not removed
    holder.join()
    assert os.path.exists(f"/dev/shm/{name}")
    assert run_child(name, 1) == (False, 4, 4, False)  # a late rank still sees our bytes
    p.release()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_unguessable_names_carry_a_secret_the_deciding_process_shares():
    a, b = unguessable_name("kvoffload-vllm-engine"), unguessable_name("kvoffload-vllm-engine")
    assert a != b and a.startswith("kvoffload-vllm-engine-") and len(a) == len("kvoffload-vllm-engine-") + 32
    int(a.rsplit("-", 1)[1], 16)
    # Ranks each propose a name; the deciding rank's (here the first) is everyone's.
    proposed = []

    def broadcast(name):
        proposed.append(name)
        return proposed[0]

    names = [unguessable_name("kvoffload-vllm-engine", broadcast) for _ in range(3)]
    assert names == [proposed[0]] * 3 and len(set(proposed)) == 3
    with pytest.raises(ValueError, match=r"share: expected 'p' and a 32-digit secret"):
        unguessable_name("p", lambda name: "p-guessable")
    with pytest.raises(ValueError, match=r"prefix: at most 222 bytes"):
        unguessable_name("p" * 223)


def test_remove_leftovers_removes_only_this_users_files_no_one_holds(tmp_path):
    prefix = "kvoffload-test-left-"
    left = tmp_path / f"{prefix}dead"
    left.write_bytes(b"\x01" * 4096)
    left.chmod(0o600)
    held = SharedFile(f"{prefix}live", 4096, str(tmp_path))  # its lock, as a live process holds it
    wide = tmp_path / f"{prefix}wide"
    wide.write_bytes(b"\x02")
    wide.chmod(0o644)  # not a file kvoffload made: left alone
    target = tmp_path / "precious"
    target.write_bytes(b"\x03")
    target.chmod(0o600)
    os.symlink(target, tmp_path / f"{prefix}link")
    other = tmp_path / "kvoffload-other"
    other.write_bytes(b"\x04")
    other.chmod(0o600)
    assert remove_leftovers(prefix, str(tmp_path)) == [f"{prefix}dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{prefix}live", f"{prefix}wide", f"{prefix}link", "precious", "kvoffload-other"])
    assert target.read_bytes() == b"\x03"
    assert held.close() is True  # still its file, removed by its last holder
    assert remove_leftovers(prefix, str(tmp_path / "missing")) == []


def test_a_killed_process_leaves_a_file_that_remove_leftovers_removes(name):
    run_child(name, 7, crash=True)  # the child dies attached: its file stays named, held by no one
    assert os.path.exists(f"/dev/shm/{name}")
    assert remove_leftovers(name) == [name]


def test_a_file_that_holds_another_pool_is_refused_naming_both(name):
    first = SharedFile(name, 4096, tag="pool A: 2 tensors")
    again = SharedFile(name, 4096, tag="pool A: 2 tensors")  # the same pool: attached
    assert not again.created and again.close() is False
    with pytest.raises(ValueError, match=rf"shm_name: /dev/shm/{name} holds another pool \(pool A: 2 tensors\); "
                                         r"this one is pool B: 1 tensor: two pools under one name"):
        SharedFile(name, 4096, tag="pool B: 1 tensor")
    with pytest.raises(ValueError, match=r"holds 8192 bytes, this pool needs 4096"):
        SharedFile(name, 4096)  # untagged: the size tells
    assert first.close() is True
