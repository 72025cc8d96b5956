"""kvoffload.pool.registrations: registration edges never cut a chunk, and copies are cut at them."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.pool.layout import chunk_runs
from kvoffload.pool.registrations import PAGE, ChunkRun, registration_ends, split_at


def cuts_a_unit(at, runs):
    return any(r.start < at < r.end and (at - r.start) % r.chunk_bytes for r in runs)


@st.composite
def pools(draw):
    """Runs laid end to end with gaps, as a layout gives, and the pool's size."""
    runs, at = [], 0
    for _ in range(draw(st.integers(0, 4))):
        at += draw(st.sampled_from([0, 100, PAGE]))
        chunk = draw(st.sampled_from([800, PAGE, 3 * PAGE, 2 << 20, 4097, 5 * 4096 + 512]))
        count = draw(st.integers(1, 200))
        runs.append(ChunkRun(at, chunk, at + chunk * count))
        at += chunk * count
    size = -(-max(at, 1) // PAGE) * PAGE
    return runs, size


@settings(max_examples=300, deadline=None)
@given(pools(), st.sampled_from([PAGE, 3 * PAGE, 64 << 10, 1 << 20]))
def test_registrations_end_on_pages_between_chunks_and_cover_the_pool(pool, registration_bytes):
    runs, size = pool
    ends = registration_ends(size, runs, registration_bytes)
    assert ends[-1] == size and ends == sorted(set(ends))
    for end in ends:
        assert end % PAGE == 0
        assert not cuts_a_unit(end, runs), end


def test_registrations_are_no_larger_than_asked_where_chunks_allow():
    runs = [ChunkRun(0, 64 << 10, 1 << 30)]
    ends = registration_ends(1 << 30, runs, 100 << 20)
    assert np.diff([0] + ends).max() <= 100 << 20
    assert len(ends) == -(-(1 << 30) // (100 << 20))


def test_a_chunk_larger_than_a_registration_makes_it_larger():
    runs = [ChunkRun(0, 3 << 20, 30 << 20)]
    assert registration_ends(30 << 20, runs, 1 << 20) == [(3 << 20) * k for k in range(1, 11)]


def test_layouts_give_runs_of_whole_chunks_or_whole_slots():
    pages, chunks, bpc = [[4096, 8192], [1000]], [3, 5], 2
    major = chunk_runs(pages, chunks, bpc, "chunk_major")
    assert major == [ChunkRun(0, 2 * 12288, 3 * 2 * 12288), ChunkRun(73728, 2000, 73728 + 10000)]
    per_tensor = chunk_runs(pages, chunks, bpc, "per_tensor")
    assert per_tensor[:2] == [ChunkRun(0, 8192, 3 * 8192), ChunkRun(3 * 8192, 16384, 3 * 8192 + 3 * 16384)]


def test_registration_bytes_below_a_page_is_refused():
    with pytest.raises(ValueError, match="registration_bytes: must be >= 4096"):
        registration_ends(1 << 20, [], 100)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_split_copies_cross_no_edge_and_cover_the_same_bytes(data):
    edges = np.array(sorted(set(data.draw(st.lists(st.integers(1, 1000), max_size=8)))), np.int64)
    n = data.draw(st.integers(0, 20))
    host = np.array(data.draw(st.lists(st.integers(0, 900), min_size=n, max_size=n)), np.int64)
    sizes = np.array(data.draw(st.lists(st.integers(1, 300), min_size=n, max_size=n)), np.int64)
    other = host * 7 + 10_000
    h, o, z = split_at(edges, host, other, sizes)
    assert (z > 0).all()
    for start, size in zip(h, z):
        assert not ((edges > start) & (edges < start + size)).any()
    want = [(a + k, b + k) for a, b, s in zip(host, other, sizes) for k in range(s)]
    got = [(a + k, b + k) for a, b, s in zip(h, o, z) for k in range(s)]
    assert got == want


def test_split_returns_the_same_arrays_when_nothing_crosses():
    host, other, sizes = np.array([0, 100]), np.array([5, 6]), np.array([100, 50])
    assert split_at(np.array([100, 150]), host, other, sizes)[0] is host
