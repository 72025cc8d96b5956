"""kvoffload.shm_file and shared pools across processes: one creates the file, the others
attach to it and see the same bytes, the last one out removes it, even after a crash."""

import multiprocessing
import os
import uuid

import numpy as np
import pytest

from kvoffload.host_pool import HostPool, PoolOptions
from kvoffload.shm_file import SharedFile

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
    with open(f"/dev/shm/{name}", "wb") as f:
        f.truncate(-(-NBYTES // 4096) * 4096)
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
