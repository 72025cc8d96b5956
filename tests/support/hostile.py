"""Hostile inputs the fuzz tests share: ids, handler jobs, and what a block mapping must do."""

from __future__ import annotations

import concurrent.futures

from hypothesis import strategies as st

from kvoffload.pages.planner import CPUSpec, GPUSpec

from kv_model import submit_job

ids = st.one_of(st.integers(-3, 20), st.sampled_from([-(2**63), 2**63 - 1, 2**31, -(2**31)]))

# (direction, block ids, chunk ids, first block index) per job.
jobs = st.lists(st.tuples(st.sampled_from(["store", "load"]), st.lists(ids, max_size=5),
                          st.lists(ids, max_size=4), st.integers(-1, 3)), min_size=1, max_size=6)


def submit_jobs(handler, hostile_jobs, prefix=None) -> list:
    """Submits the jobs (ids i, or (prefix, i)); those refused must raise TypeError or
    ValueError. Returns the ids submitted."""
    submitted = []
    for i, (direction, block_ids, chunk_ids, first) in enumerate(hostile_jobs):
        job_id = i if prefix is None else (prefix, i)
        try:
            gpu_spec, cpu_spec = GPUSpec(block_ids, [len(block_ids)], [first]), CPUSpec(chunk_ids)
            submit_job(handler, job_id, direction, gpu_spec, cpu_spec)
            submitted.append(job_id)
        except (TypeError, ValueError):
            pass
    return submitted


def run_jobs(handler, hostile_jobs) -> None:
    """Submits the jobs; every one submitted must finish successfully. Shuts the handler
    down."""
    submitted = submit_jobs(handler, hostile_jobs)
    handler.wait(submitted)
    results = handler.get_finished()
    assert sorted(r.job_id for r in results) == submitted and all(r.success for r in results)
    handler.shutdown()


def run_jobs_from_two_threads(handler, first, second) -> None:
    """Submits two lists of jobs from two threads at once, as run_jobs checks one list.
    Shuts the handler down."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        submitted = [pool.submit(submit_jobs, handler, hostile, prefix)
                     for prefix, hostile in ((0, first), (1, second))]
        job_ids = sum((s.result() for s in submitted), [])
    handler.wait(job_ids)
    results = handler.get_finished()
    assert sorted(r.job_id for r in results) == sorted(job_ids) and all(r.success for r in results)
    handler.shutdown()


def mapping_is_valid(pairs, src_blocks: int, dst_blocks: int) -> bool:
    """Every id in range, no destination twice."""
    return (all(0 <= s < src_blocks and 0 <= d < dst_blocks for s, d in pairs)
            and len({d for _, d in pairs}) == len(pairs))


def copied(src, dst_before, pairs):
    """What dst holds after block s of src is copied to block d, for every (s, d)."""
    want = dst_before.copy()
    for s, d in pairs:
        want[d] = src[s]
    return want



def another_uid() -> int | None:
    """A uid other than this process's that files can be given to (chown), as another
    user would own them: needs root, and a user namespace (Bazel's sandbox maps only
    root) that maps it; None where there is none."""
    import os
    import tempfile

    if os.geteuid() != 0:
        return None
    uid = 65534
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix=".kvoffload-test-") as f:
        try:
            os.fchown(f.fileno(), uid, -1)
        except OSError:  # EINVAL: not mapped in this user namespace
            return None
    return uid


def _drop_privileges() -> None:
    """Makes this process another user (uid 65534) where it is root and that user exists
    in its user namespace; else, as root of a namespace that maps no other uid, drops
    every capability (CAP_DAC_OVERRIDE among them), so that file modes bind it."""
    import ctypes
    import os

    if os.geteuid() != 0:
        return
    try:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        return
    except OSError:
        pass

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: none
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset: could not drop this process's capabilities")


def as_another_user(function, *args):
    """Runs ``function(*args)`` in a forked child that file permissions bind as they bind
    another user (see _drop_privileges), and returns what it returns or raises what it
    raises (pickled back)."""
    import os
    import pickle

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                _drop_privileges()
                result = (True, function(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the parent
                result = (False, e)
            with os.fdopen(write, "wb") as f:
                pickle.dump(result, f)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    assert data, "the child died before it could report"
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    return value
