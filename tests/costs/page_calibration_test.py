"""kvoffload.costs.page_calibration without a GPU: the choice by max_slowdown, and the entry in
the calibration cache file beside the raw-pointer one; measuring is stood in for."""

import dataclasses
import json
import logging
import re

import numpy as np
import pytest
import torch

import kvoffload as kv
from kvoffload.costs import cache as calibration_cache
from kvoffload.costs import calibration, page_calibration
from kvoffload.costs.cache import CalibrationCacheError
from kvoffload.costs.page_calibration import PageCalibration
from kvoffload.jobs import methods as job_methods
from kvoffload.pages import paths as page_methods
from kvoffload.pages.planner import GroupLayout, KVLayout, TensorLayout
from kvoffload.util.vocabulary import Direction
from fake_device import fake_device

DMA, STAGED = kv.PagePath.DMA, kv.PagePath.STAGED
PAGES = [4 << 10, 16 << 10, 64 << 10]


def fake(key="fake GPU 0 | pages", dma=(0.000, 0.001, 0.002), ring=(0.030, 0.020, 0.010),
         dma_rate=(12.0, 30.0, 54.0), ring_rate=(47.0, 48.0, 46.0), rows=(0.004, 0.004, 0.004),
         rows_rate=(30.0, 45.0, 50.0)):
    """The same figures both ways: DMA gentle and slow at small pages, the ring fast and
    costly, 2D copies over one allocation between them."""
    alone, beside, over_bulk, noisy = {}, {}, {}, {}
    for d in Direction:
        for key_, cost, rate in (("pages_dma", dma, dma_rate), ("pages_staged", ring, ring_rate),
                                 ("pages_dma_rows", rows, rows_rate)):
            key_ = f"{key_} {d.value}"
            alone[key_], beside[key_], over_bulk[key_], noisy[key_] = [r + 1 for r in rate], list(rate), list(cost), [False] * 3
    return PageCalibration(key, list(PAGES), alone, beside, over_bulk, noisy, {"store": 0.004, "load": 0.006})


def pages(page, tensors=4):
    return [[page] * tensors]


def layout(page, tensors=4):
    gpu, cpu = 1 << 40, 1 << 30
    group = GroupLayout(tuple(TensorLayout(gpu + i * 64 * page, page, page, cpu + i * 64 * page, page)
                              for i in range(tensors)), 64, 64)
    return KVLayout((group,), 1)


@pytest.mark.parametrize("max_slowdown, page, path", [
    (0.05, 4 << 10, STAGED),   # both within: the faster beside
    (0.01, 4 << 10, DMA),      # the ring costs 3%: DMA, though slower
    (0.01, 64 << 10, DMA),     # both within at 64 KiB: DMA moves more
    (0.015, 16 << 10, DMA),    # the ring's 2% at 16 KiB is over
    (0.025, 16 << 10, STAGED),
    (0.026, 8 << 10, STAGED),  # log-interpolated: the ring costs 2.5% at 8 KiB
    (0.024, 8 << 10, DMA),
])
def test_the_fastest_path_within_max_slowdown_wins(max_slowdown, page, path):
    cal = fake()
    assert cal.choose(page, max_slowdown) == path
    assert page_methods.choose(kv.Pages(max_slowdown=max_slowdown), pages(page), cal=cal) == {
        d: path for d in Direction}


@pytest.mark.parametrize("ring_rate, path", [(56.0, DMA), (57.5, STAGED)])
def test_rates_within_the_tie_go_to_the_cheaper_path(ring_rate, path):
    # At 64 KiB DMA moves 54 each way for 0.2%, the ring ring_rate for 1%.
    cal = fake(ring_rate=(47.0, 48.0, ring_rate))
    assert cal.choose(64 << 10, 0.05) == path


def test_costs_and_rates_are_log_interpolated_and_held_at_the_ends():
    cal = fake()
    cal.over_bulk["pages_staged store"][1] = 0.05
    assert cal.worst_cost(STAGED, 16 << 10) == pytest.approx(0.05)  # the store's, over the load's 2%
    cal.over_bulk["pages_staged store"][1] = 0.02
    assert cal.cost(STAGED, Direction.LOAD, 8 << 10) == pytest.approx(0.025)
    assert cal.rate(DMA, Direction.STORE, 32 << 10) == pytest.approx(42.0)
    assert cal.cost(STAGED, Direction.STORE, 512) == pytest.approx(0.030)
    assert cal.rate(DMA, Direction.LOAD, 1 << 30) == pytest.approx(54.0)


def test_a_noisy_figure_is_found_where_the_choice_reads_it():
    cal = fake()
    cal.noisy["pages_staged load"][1] = True  # 16 KiB
    assert not cal.noisy_at(Direction.STORE, 16 << 10)
    assert cal.noisy_at(Direction.LOAD, 8 << 10) and cal.noisy_at(Direction.LOAD, 16 << 10)
    assert cal.noisy_at(Direction.LOAD, 32 << 10)
    assert not cal.noisy_at(Direction.LOAD, 4 << 10) and not cal.noisy_at(Direction.LOAD, 1 << 30)


def test_without_a_gpu_a_page_calibration_names_what_needs_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(kv.NoCudaDeviceError, match=r"Pages\(max_slowdown\): no CUDA device"):
        page_calibration.page_calibration()
    with pytest.raises(kv.NoCudaDeviceError, match="method='auto': no CUDA device"):
        calibration.calibration()


def test_where_none_is_within_the_gentlest_wins_and_without_batch_copy_the_ring():
    cal = fake(dma=(0.02, 0.02, 0.02), ring=(0.03, 0.01, 0.03))
    assert cal.choose(4 << 10, 0.001) == DMA
    assert cal.choose(16 << 10, 0.001) == STAGED
    assert cal.choose(64 << 10, 1.0, batch_copy=False) == STAGED


def test_both_directions_take_one_path_within_in_both():
    cal = fake()
    cal.over_bulk["pages_staged load"] = [0.0, 0.0, 0.0]  # within for loads, not for stores
    assert page_methods.choose(kv.Pages(max_slowdown=0.01), pages(4 << 10), cal=cal) == {d: DMA for d in Direction}
    cal.over_bulk["pages_staged store"] = [0.0, 0.0, 0.0]
    assert page_methods.choose(kv.Pages(max_slowdown=0.01), pages(4 << 10), cal=cal) == {
        d: STAGED for d in Direction}


def test_where_none_is_within_the_costlier_direction_decides():
    cal = fake(dma=(0.02, 0.02, 0.02), ring=(0.03, 0.01, 0.03))
    cal.over_bulk["pages_dma load"] = [0.04, 0.04, 0.04]  # DMA's loads cost more than the ring's stores
    assert cal.choose(4 << 10, 0.001) == STAGED


def test_a_max_slowdown_is_checked_and_needs_a_calibration():
    with pytest.raises(ValueError, match="max_slowdown: chooses a path, and path 'pages_dma' is forced"):
        kv.Pages(DMA, max_slowdown=0.01)
    for bad in (-0.01, True, "0.01", float("nan"), 10 ** 400):
        with pytest.raises(ValueError, match="max_slowdown: must be a number >= 0 or None"):
            kv.Pages(max_slowdown=bad)
    with pytest.raises(ValueError, match="cal: a page method with a max_slowdown chooses from a page calibration"):
        page_methods.choose(kv.Pages(max_slowdown=0.01), pages(4096))
    # The built-in choice and forced paths need none.
    assert page_methods.choose(kv.Pages(), pages(64 << 10)) == {d: DMA for d in Direction}
    assert kv.Pages(max_slowdown=0.01).name == "pages"


@pytest.fixture
def machine(tmp_path, monkeypatch):
    return fake_device(tmp_path, monkeypatch, page_calibration, fake, page_calibration.SUFFIX)


def test_measured_once_then_read_back_beside_the_raw_pointer_entry(machine, monkeypatch):
    file, measured = machine
    file.write_text(json.dumps({"fake GPU 0": {"format": calibration.FORMAT, "other": "kept"}}))
    first = page_calibration.page_calibration()
    assert page_calibration.page_calibration() is first and measured == [0]
    entries = json.loads(file.read_text())
    assert entries["fake GPU 0"] == {"format": calibration.FORMAT, "other": "kept"}
    assert entries["fake GPU 0 | pages"]["format"] == PageCalibration.FORMAT
    monkeypatch.setattr(calibration_cache, "_cached", {})
    assert page_calibration.page_calibration(0) == first and measured == [0]
    page_calibration.page_calibration(0, recalibrate=True)
    assert measured == [0, 0]


@pytest.mark.parametrize("format, key", [(0, "fake GPU 0 | pages"), (2, "fake GPU 0"),  # 2: keyed without the suffix
                                         (3, "fake GPU 0 | pages"), (4, "fake GPU 0 | pages"),
                                         (5, "fake GPU 0 | pages")])
def test_an_entry_of_another_format_is_measured_again(machine, format, key):
    file, measured = machine
    file.write_text(json.dumps({"fake GPU 0 | pages": dict(dataclasses.asdict(fake(key)), format=format)}))
    page_calibration.page_calibration(0)
    assert measured == [0]
    assert json.loads(file.read_text())["fake GPU 0 | pages"]["key"] == "fake GPU 0 | pages"


def test_a_measurement_of_another_key_is_not_written(machine, monkeypatch):
    file, _ = machine
    monkeypatch.setattr(page_calibration, "measure", lambda d: fake("fake GPU 0"))
    with pytest.raises(AssertionError, match=re.escape("measured 'fake GPU 0' for 'fake GPU 0 | pages'")):
        page_calibration.page_calibration(0)
    assert not file.exists()


@pytest.mark.parametrize("spoil, why", [
    (lambda e: e["over_bulk"].pop("pages_dma load"), "does not hold a calibration"),
    (lambda e: e["beside"]["pages_dma load"].append(1.0), "does not hold a calibration"),
    (lambda e: e["alone"]["pages_staged store"].__setitem__(1, "fast"), "does not hold a calibration"),
    (lambda e: e["noisy"]["pages_dma load"].__setitem__(0, 1), "does not hold a calibration"),
    (lambda e: e["bulk_slowdown"].pop("load"), "does not hold a calibration"),
    (lambda e: e.__setitem__("page_bytes", [4096, 0, 65536]), "does not hold a calibration"),
    (lambda e: e.__setitem__("page_bytes", []), "does not hold a calibration"),
    (lambda e: e.__setitem__("page_bytes", [65536, 4096, 16384]), "does not hold a calibration"),
    (lambda e: e.__setitem__("page_bytes", [4096, 4096, 16384]), "does not hold a calibration"),
    (lambda e: e.__setitem__("page_bytes", [4096, 16384.5, 65536]), "does not hold a calibration"),
    (lambda e: e.__setitem__("page_bytes", [4096, 16384, 10 ** 400]), "does not hold a calibration"),
    (lambda e: e["over_bulk"]["pages_staged load"].__setitem__(0, float("nan")), "does not hold a calibration"),
    (lambda e: e["beside"]["pages_dma store"].__setitem__(2, float("inf")), "does not hold a calibration"),
    (lambda e: e["beside"]["pages_dma store"].__setitem__(2, -1.0), "does not hold a calibration"),
    (lambda e: e["bulk_slowdown"].__setitem__("store", float("nan")), "does not hold a calibration"),
    (lambda e: e.__setitem__("surprise", 1), "unexpected keyword argument 'surprise'"),
    (lambda e: e.__setitem__("key", "fake GPU 1 | pages"), "holds the calibration of 'fake GPU 1 | pages'"),
    (lambda e: e.__setitem__("key", "fake GPU 0"), "holds the calibration of 'fake GPU 0'"),
])
def test_a_corrupt_entry_is_named_and_not_measured_over(machine, spoil, why):
    file, measured = machine
    entry = dict(dataclasses.asdict(fake()), format=PageCalibration.FORMAT)
    spoil(entry)
    file.write_text(json.dumps({"fake GPU 0 | pages": entry}))
    with pytest.raises(CalibrationCacheError, match=f"{file}: corrupt calibration cache .*{why}.*; replace it "
                                                    "with python -m kvoffload.costs.page_calibration --recalibrate"):
        page_calibration.page_calibration(0)
    assert measured == []
    page_calibration.page_calibration(0, recalibrate=True)  # what the message says mends it
    assert measured == [0] and page_calibration.page_calibration(0).valid()


def test_a_cpu_handler_with_a_max_slowdown_copies_without_a_calibration(machine):
    _, measured = machine
    gpu = [[torch.randint(0, 255, (8, 64), dtype=torch.uint8) for _ in range(2)]]
    handler = kv.OffloadHandler(gpu, 4, 2, method=kv.Pages(max_slowdown=0.01))
    try:
        assert handler.methods == {"store": "host", "load": "host"} and measured == []
    finally:
        handler.shutdown()


def test_the_calibrations_jobs_share_no_block_and_no_chunk():
    import numpy as np
    jobs = page_calibration._jobs(np.random.default_rng(1), 100, page_calibration.JOBS)
    blocks = np.concatenate([b for b, _ in jobs])
    chunks = np.concatenate([c for _, c in jobs])
    assert len(jobs) == page_calibration.JOBS and all(len(b) == len(c) == 100 for b, c in jobs)
    assert sorted(blocks.tolist()) == sorted(chunks.tolist()) == list(range(100 * page_calibration.JOBS))


def test_the_command_line_recalibrates_and_prints_every_path(machine, capsys):
    _, measured = machine
    for bad in ([], ["--recalibrate", "--device"], ["--recalibrate", "--device", "one"],
                ["--recalibrate", "--device", "\u00b2"]):
        with pytest.raises(SystemExit, match="usage: python -m kvoffload.costs.page_calibration --recalibrate"):
            page_calibration.main(bad)
    page_calibration.main(["--recalibrate", "--device", "1"])
    out = capsys.readouterr().out
    assert measured == [1] and "fake GPU 1 | pages: written to" in out
    assert all(f"{v} {d.value}" in out for v in page_calibration.VARIANTS for d in Direction)


class _Spanless:
    """A page table whose tensors span nothing: PageJobs checks no extent."""

    def spans(self):
        return np.zeros(4, np.int64), np.zeros(4, np.int64)


@pytest.mark.parametrize("max_slowdown, batch_copy, says", [
    (0.05, True, "stores by pages_staged, loads by pages_staged (+3.00% over bulk copies' slowdown by the page "
                 "calibration, within 5.00%)"),
    (0.001, True, "stores by pages_dma, loads by pages_dma (+0.50% over bulk copies' slowdown by the page "
                  "calibration, the least; none is within 0.10%)"),
    (0.05, False, "stores by pages_staged, loads by pages_staged (the ring: the driver has no batch copy)"),
])
def test_page_jobs_log_their_choice_and_its_cost(caplog, max_slowdown, batch_copy, says):
    cal = fake(dma=(0.005, 0.005, 0.005))
    cal.noisy["pages_dma load"][0] = True
    with caplog.at_level(logging.INFO, logger="kvoffload.jobs.methods"):
        method = kv.Pages(max_slowdown=max_slowdown)
        choice = job_methods.PageChoice.of(method, pages(4 << 10), batch_copy, cal)
        jobs = job_methods.PageJobs(method, layout(4 << 10), _Spanless(), None, choice)
    assert f"kvoffload: 4096 page bytes on average: {says}" in caplog.text
    assert "the page calibration's load figures near 4096 page bytes were noisy" in caplog.text
    assert "store figures" not in caplog.text
    assert set(jobs.methods.values()) == {says.split()[2].rstrip(",")}


@pytest.mark.parametrize("method, page, own_pool, batch_copy, expected", [
    (kv.Pages(), 64 << 10, True, True, "per_tensor"),
    (kv.Pages(), 4 << 10, True, True, "chunk_major"),  # the ring
    (kv.Pages(), 64 << 10, False, True, "chunk_major"),  # shared, the caller's, or pinned in the background
    (kv.Pages(), 64 << 10, True, False, "chunk_major"),  # no batch copy: the ring
    (kv.Pages(DMA), 4 << 10, True, True, "per_tensor"),
    (kv.Pages(STAGED), 64 << 10, True, True, "chunk_major"),
    (kv.Pages(max_slowdown=0.05), 4 << 10, True, True, "chunk_major"),  # the calibration takes the ring
    (kv.Pages(max_slowdown=0.001), 4 << 10, True, True, "per_tensor"),  # and here DMA
    (kv.Auto(None), 64 << 10, True, True, "chunk_major"),
    ("batch", 64 << 10, True, True, "chunk_major"),
])
def test_the_default_pool_layout_follows_the_chosen_path(monkeypatch, method, page, own_pool, batch_copy, expected):
    monkeypatch.setattr(job_methods, "batch_entry_point_version", lambda: 1 if batch_copy else 0)
    monkeypatch.setattr(page_calibration, "page_calibration", lambda device: fake())
    method = job_methods.method_object(method)
    choice = job_methods.page_choice(method, torch.device("cuda", 0), pages(page))
    assert job_methods.cpu_layout_for(choice, own_pool) == expected
    assert job_methods.page_choice(method, torch.device("cpu"), pages(page)) is None
    assert job_methods.cpu_layout_for(None, own_pool) == "chunk_major"


def test_page_jobs_run_the_paths_their_pool_was_laid_out_for(monkeypatch):
    """The page calibration is read once per handler: a recalibration between the pool's
    layout and the page jobs changes neither."""
    cals = iter([fake(), fake(ring=(0.5, 0.5, 0.5))])  # the second takes DMA at 4 KiB within 5%
    monkeypatch.setattr(job_methods, "batch_entry_point_version", lambda: 1)
    monkeypatch.setattr(page_calibration, "page_calibration", lambda device: next(cals))
    method = kv.Pages(max_slowdown=0.05)
    choice = job_methods.page_choice(method, torch.device("cuda", 0), pages(4 << 10))
    assert set(choice.paths.values()) == {STAGED} and job_methods.cpu_layout_for(choice) == "chunk_major"
    assert page_methods.choose(method, pages(4 << 10), True, next(cals)) == {d: DMA for d in Direction}
    jobs = job_methods.job_method(method, torch.device("cuda", 0), layout(4 << 10), _Spanless(), None, None, choice)
    assert jobs.paths == choice.paths and set(jobs.methods.values()) == {"pages_staged"}
    with pytest.raises(ValueError, match="choice: a page method on a GPU"):
        job_methods.job_method(method, torch.device("cuda", 0), layout(4 << 10), _Spanless(), None, None)


class _Rows(_Spanless):
    """A page table that answers, per group, whether it moves blocks as 2D copies."""

    def __init__(self, rows):
        self._rows = rows

    def rows(self, device):
        return self._rows


def _one_allocation(page, tensors=4, blocks=16):
    backing = torch.zeros(tensors * blocks * page, dtype=torch.uint8)
    return [[backing[i * blocks * page:(i + 1) * blocks * page].view(blocks, page) for i in range(tensors)]]


@pytest.mark.parametrize("page", [4 << 10, 16 << 10, 64 << 10])
@pytest.mark.parametrize("method", [kv.Pages(), kv.Pages(path=DMA)])
def test_a_choice_whose_dma_goes_by_rows_lays_the_pool_out_chunk_by_chunk(monkeypatch, page, method):
    # Rows take 4-16 KiB pages to DMA, in 2D copies; 64 KiB pages go a copy per page, as
    # fast (dma2d_probe_h200.json), from a per-tensor pool.
    monkeypatch.setattr(job_methods, "batch_entry_point_version", lambda: 1)
    choice = job_methods.page_choice(method, torch.device("cuda", 0), pages(page), _one_allocation(page))
    small = page < page_methods.ROWS_BELOW_PAGE_BYTES
    assert choice.paths == {d: DMA for d in Direction} and choice.by_rows == small
    assert job_methods.cpu_layout_for(choice, True) == ("chunk_major" if small else "per_tensor")
    apart = job_methods.page_choice(method, torch.device("cuda", 0), pages(page), [[]])
    assert apart.paths == {d: DMA for d in Direction} or page < 20 << 10
    assert not apart.by_rows and job_methods.cpu_layout_for(apart, True) == page_methods.cpu_layout(apart.paths)
    ring = job_methods.page_choice(kv.Pages(path=STAGED), torch.device("cuda", 0), pages(page), _one_allocation(page))
    assert not ring.by_rows
    apart = [[torch.zeros(16, page, dtype=torch.uint8) for _ in range(4)]]
    assert not job_methods.page_choice(kv.Pages(), torch.device("cuda", 0), pages(page), apart).by_rows
    assert not job_methods.page_choice(kv.Pages(strided=False), torch.device("cuda", 0), pages(page),
                                       _one_allocation(page)).by_rows


def test_page_jobs_take_the_ring_where_the_driver_refuses_the_rows_the_choice_rested_on(monkeypatch):
    monkeypatch.setattr(job_methods, "batch_entry_point_version", lambda: 1)
    choice = job_methods.page_choice(kv.Pages(), torch.device("cuda", 0), pages(4 << 10), _one_allocation(4 << 10))
    refused = _Rows([(False, "the GPU tensors are not one allocation", 4, 0, 0)])
    jobs = job_methods.PageJobs(kv.Pages(), layout(4 << 10), refused, None, choice, 0)
    assert set(jobs.methods.values()) == {"pages_staged"}
    assert "not rows the driver copies in 2D (group 0: the GPU tensors are not one allocation)" in jobs.reasons["load"]
    taken = _Rows([(True, "", 4, 64 << 12, 64 << 12)])
    jobs = job_methods.PageJobs(kv.Pages(), layout(4 << 10), taken, None, choice, 0)
    assert set(jobs.methods.values()) == {"pages_dma"}
    assert jobs.reasons["store"] == ("built-in choice: every group's tensors are rows of one allocation; "
                                     "DMA by 2D copies, a row per tensor, for group [0]")


def test_over_rows_of_one_allocation_the_choice_reads_the_2d_copies_figures():
    # At 4 KiB, 2D copies move 46 GB/s for 0.4%, the ring 47 for 3%: within the tie, the
    # cheaper; a copy per page (12 GB/s) would leave the ring the faster.
    cal = fake(rows_rate=(46.0, 47.0, 50.0))
    assert cal.choose(4 << 10, 0.05) == STAGED
    assert cal.choose(4 << 10, 0.05, rows=True) == DMA
    assert cal.cost(DMA, Direction.STORE, 4 << 10, rows=True) == pytest.approx(0.004)
    assert cal.cost(STAGED, Direction.STORE, 4 << 10, rows=True) == pytest.approx(0.030)  # the ring is the ring
    method = kv.Pages(max_slowdown=0.05)
    assert page_methods.choose(method, pages(4 << 10), True, cal, True) == {d: DMA for d in Direction}


def test_a_calibrated_choice_on_rows_the_driver_refuses_is_made_again_without_them(monkeypatch):
    cal = fake(rows_rate=(46.0, 47.0, 50.0))
    monkeypatch.setattr(job_methods, "batch_entry_point_version", lambda: 1)
    monkeypatch.setattr(page_calibration, "page_calibration", lambda device: cal)
    method = kv.Pages(max_slowdown=0.05)
    choice = job_methods.page_choice(method, torch.device("cuda", 0), pages(4 << 10), _one_allocation(4 << 10))
    assert choice.by_rows and set(choice.paths.values()) == {DMA}
    taken = job_methods.PageJobs(method, layout(4 << 10), _Rows([(True, "", 4, 64 << 12, 64 << 12)]), None, choice, 0)
    assert set(taken.methods.values()) == {"pages_dma"}
    assert taken.reasons["store"].startswith("+0.40% over bulk copies' slowdown by the page calibration, within 5.00%")
    refused = job_methods.PageJobs(method, layout(4 << 10), _Rows([(False, "the GPU tensors are not one allocation",
                                                                    4, 0, 0)]), None, choice, 0)
    assert set(refused.methods.values()) == {"pages_staged"}
    assert refused.reasons["load"] == ("+3.00% over bulk copies' slowdown by the page calibration, within 5.00%; the "
                                       "tensors are not rows the driver copies in 2D (group 0: the GPU tensors are "
                                       "not one allocation)")


@pytest.mark.parametrize("method", [kv.Pages(), kv.Pages(path=DMA)])
def test_no_2d_copies_unless_every_group_is_rows_of_small_pages(monkeypatch, method):
    # A group apart takes a per-tensor pool, where the row groups' 2D copies would have
    # their host rows a region apart; a group of 32 KiB pages beside one of 4 KiB keeps
    # the mean under the limit but is no small page.
    monkeypatch.setattr(job_methods, "batch_entry_point_version", lambda: 1)
    apart = [torch.zeros(16, 4 << 10, dtype=torch.uint8) for _ in range(4)]
    mixed = job_methods.page_choice(method, torch.device("cuda", 0), [[4 << 10] * 4] * 2,
                                    _one_allocation(4 << 10) + [apart])
    assert not mixed.by_rows
    large = job_methods.page_choice(method, torch.device("cuda", 0), [[4 << 10] * 4, [32 << 10]] ,
                                    _one_allocation(4 << 10) + _one_allocation(32 << 10, tensors=1))
    assert not large.by_rows
    rows = job_methods.page_choice(method, torch.device("cuda", 0), [[4 << 10] * 4], _one_allocation(4 << 10))
    assert rows.by_rows and not rows.without_rows(method, [[4 << 10] * 4]).by_rows
    assert rows.without_rows(method, [[4 << 10] * 4]).paths == page_methods.choose(method, [[4 << 10] * 4], True)
