"""A job made and started on lanes in one call, and retired in one: what the lane tests
do to every job, which the handler does in separate steps."""


def submit(lanes, lane, copy, waits, failing_with=(), pipelined=False, resolve=None):
    handle = lanes.make(lane, copy, waits, failing_with, pipelined, resolve)
    lanes.start(handle)
    return handle


def finish(lanes, handle):
    """(seconds, error), the job's handle recycled."""
    got = lanes.result(handle)
    lanes.recycle(handle)
    return got
