"""compute_loop.in_pieces without a GPU: every copy once, in order, in calls of about the
asked bytes."""

import numpy as np
import pytest

from kvoffload import compute_loop


def calls_of(sizes, piece_bytes):
    src = np.arange(len(sizes), dtype=np.int64) * 7 + 3
    dst = np.arange(len(sizes), dtype=np.int64) * 11 + 5
    made = []
    for piece in compute_loop.in_pieces(lambda s, d, z: made.append((s, d, z)), src, dst, sizes, piece_bytes):
        piece()
    return src, dst, made


@pytest.mark.parametrize("seed", range(20))
def test_pieces_hold_every_copy_once_in_order(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5000, int(rng.integers(1, 400))).astype(np.int64)
    piece_bytes = int(rng.integers(1, 20000))
    src, dst, made = calls_of(sizes, piece_bytes)
    assert all(len(s) for s, _, _ in made)
    for got, want in zip((np.concatenate([m[k] for m in made]) for k in range(3)), (src, dst, sizes)):
        np.testing.assert_array_equal(got, want)
    # A piece ends with the first copy that reaches the next multiple of piece_bytes.
    start = 0
    for i, (_, _, z) in enumerate(made):
        ends = start + np.cumsum(z)
        assert (ends[:-1] // piece_bytes == start // piece_bytes).all()
        if i < len(made) - 1:
            assert ends[-1] // piece_bytes > start // piece_bytes
        start = ends[-1]

def test_equal_pages_split_evenly():
    sizes = np.full(10_000, 4096, dtype=np.int64)
    _, _, made = calls_of(sizes, 32 << 20 >> 6)  # 512 KiB: 128 pages a piece
    assert [len(z) for _, _, z in made] == [128] * 78 + [16]


def test_no_copies_no_pieces():
    assert calls_of(np.zeros(0, dtype=np.int64), 1 << 20)[2] == []
