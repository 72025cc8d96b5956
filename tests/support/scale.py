"""KVOFFLOAD_TEST_SCALE shrinks the GPU tests' repetition counts (default 1), for runs
under compute-sanitizer, which slows every kernel and copy many times over."""

import os

SCALE = float(os.environ.get("KVOFFLOAD_TEST_SCALE", "1"))


def scaled(n: int, least: int = 2) -> int:
    return max(least, int(n * SCALE))
