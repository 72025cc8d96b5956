"""kvoffload.costs.page_calibration on a GPU: a measurement on short windows, and a handler
that chooses its paths from a calibration and copies byte for byte."""

import math

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload import _C
from kvoffload.costs import cache as calibration_cache
from kvoffload.costs import page_calibration
from kvoffload.costs.page_calibration import PAGE_BYTES, VARIANTS
from kvoffload.util.vocabulary import Direction
from kv_model import store_then_load_skipping_first_blocks


@pytest.fixture(autouse=True)
def require_gpu():
    assert torch.cuda.is_available(), "GPU tests need a CUDA device"


def test_a_measurement_holds_every_path_direction_and_page_size():
    cal = page_calibration.measure(torch.cuda.current_device(), job_bytes=8 << 20, steps=20, rounds=1,
                                   margin=6, warm=0)
    assert cal.valid() and cal.page_bytes == PAGE_BYTES
    assert cal.key == calibration_cache.device_key(torch.cuda.current_device()) + page_calibration.SUFFIX
    assert set(cal.beside) == {f"{v} {d.value}" for v in VARIANTS for d in Direction}
    assert all(min(rates) > 0 for rates in (*cal.alone.values(), *cal.beside.values()))
    # Slowdowns are fractions of a step, so each is above -1; no upper bound holds while the
    # suite's other workers share the GPU.
    assert set(cal.bulk_slowdown) == {"store", "load"}
    assert all(-1 < s < math.inf for s in cal.bulk_slowdown.values())
    assert all(-1 < s + cal.bulk_slowdown[key.split()[-1]] < math.inf
               for key, costs in cal.over_bulk.items() for s in costs)


def test_each_source_moves_its_jobs_and_rows_go_as_2d_copies():
    job_bytes = 4 << 20
    held, sources = page_calibration.page_sources(torch, "cuda", job_bytes)
    assert len(sources) == len(PAGE_BYTES) * len(VARIANTS) * len(Direction)
    for key, make in sources.items():
        copies = make()
        copies.top_up()  # two jobs in flight
        assert copies.drain() == 2 * job_bytes, key
    tables = [h for h in held if hasattr(h, "rows")]  # per page size, in VARIANTS' order
    assert len(tables) == len(PAGE_BYTES) * len(VARIANTS)
    ids, stream = np.arange(2, dtype=np.int64), torch.cuda.Stream()
    for table, (key, (path, rows)) in zip(tables, list(VARIANTS.items()) * len(PAGE_BYTES)):
        assert table.rows(torch.cuda.current_device())[0][0]  # every variant's tensors are one allocation
        if path == kv.PagePath.DMA:  # per page, or as rows
            result = table.copy(ids, ids, [2], [0], direction=_C.Direction.STORE, stream=stream, path=path,
                                strided=rows)
            assert result.path == ("rows" if rows else "batch"), key


@pytest.mark.parametrize("page", [512, 1024])
def test_a_handler_takes_the_calibrations_choice_and_copies_exactly(monkeypatch, page):
    # DMA within 1% both ways, the ring not: DMA, where the built-in choice takes the ring.
    over_bulk = {"pages_dma store": [0.0] * 3, "pages_staged store": [0.03] * 3,
                 "pages_dma load": [0.005] * 3, "pages_staged load": [0.005] * 3}
    cal = page_calibration.PageCalibration(
        "planted", list(PAGE_BYTES), {k: [10.0] * 3 for k in over_bulk}, {k: [10.0] * 3 for k in over_bulk}, over_bulk,
        {k: [False] * 3 for k in over_bulk}, {"store": 0.0, "load": 0.0})
    asked = []
    monkeypatch.setattr(page_calibration, "page_calibration", lambda device: asked.append(device) or cal)
    method = kv.Pages(max_slowdown=0.01)
    handler = store_then_load_skipping_first_blocks("cuda", "chunk_major", page, 2, method=method)
    assert handler.methods == {"store": "pages_dma", "load": "pages_dma"}
    assert asked == [torch.cuda.current_device()]
