"""kvoffload.last_writers against a dict model, on random stores and failures."""

import numpy as np
from hypothesis import given, settings, strategies as st

from kvoffload.last_writers import LastWriters


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_first_failed_matches_a_dict_of_last_writers(seed):
    rng = np.random.default_rng(seed)
    slots = [int(n) for n in rng.integers(1, 40, rng.integers(1, 4))]
    writers, model, failed = LastWriters(slots), {}, {}

    def keys():
        g = int(rng.integers(len(slots)))
        idx = rng.permutation(slots[g])[: rng.integers(0, slots[g] + 1)]
        return (np.int64(g) << 40) | idx.astype(np.int64)

    for seq in range(1, 30):
        written = keys()
        writers.record(written, seq)
        model.update(dict.fromkeys(written.tolist(), seq))
        if rng.random() < 0.3:
            failed[seq] = f"store {seq}"
        read = keys()
        want = {failed[w] for w in map(model.get, read.tolist()) if w in failed}
        got = writers.first_failed(read, failed)
        assert (got in want) if want else got is None
