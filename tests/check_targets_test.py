"""tools/check_targets.py on rows made here: which targets a run meets and by how much it
misses the others."""

import pytest

import check_targets


def row(method, direction, beside, slowdown, alone=None, layout="llama8b-64k", process="p:1", drift=0.0, **extra):
    return dict(layout=layout, method=method, direction=direction, process=process, gb_per_s=alone or beside + 1,
                gb_per_s_beside=beside, step_slowdown=slowdown, chosen="pages_dma" if direction != "both"
                else "pages_dma/pages_dma", windows=[dict(idle_drift=drift), dict(idle_drift=-drift / 2)], **extra)


def checks(rows):
    (verdict,) = check_targets.check(rows)
    return {what: (ok, figures) for what, ok, figures in verdict.checks}


def test_a_large_page_run_beside_the_prefill_loop_is_judged_on_its_slowdown_and_against_vllms_worker():
    got = checks([row("bulk", "store", 55.0, 0.005), row("vllm_worker", "store", 52.0, 0.004, alone=54.0),
                  row("pages", "store", 53.5, 0.008, alone=53.0)])
    assert got["rate >= 53 GB/s"] == (True, "53.5")
    assert got["slowdown <= +0.7%"] == (False, "+0.80%, over by 0.10% (bulk +0.50%)")
    assert got[">= vLLM's worker's rate alone"] == (False, "53.0 against 54.0")
    assert got[">= vLLM's worker's rate beside"] == (True, "53.5 against 52.0")
    assert got["slowdown <= vLLM's + 0.3%"] == (False, "+0.80% against +0.40%, vLLM's worker at 95% of bulk beside")
    assert got["every window's |idle drift| <= 0.3%"] == (True, "all")


def test_beside_another_loop_the_large_page_slowdown_is_over_bulk():
    rows = [row("bulk", "load", 55.0, 0.040, workload="decode"), row("pages", "load", 54.0, 0.045, workload="decode")]
    assert checks(rows)["slowdown over bulk <= +0.7%"] == (True, "+0.50% (bulk +4.00%)")


@pytest.mark.parametrize("share, required", [(0.89, False), (0.91, True)])
def test_the_peer_cost_rule_holds_only_where_vllms_worker_keeps_up_with_bulk(share, required):
    got = checks([row("bulk", "store", 50.0, 0.005), row("vllm_worker", "store", 50.0 * share, 0.004),
                  row("pages", "store", 53.0, 0.009)])
    assert got["slowdown <= vLLM's + 0.3%"][0] is (False if required else None)


@pytest.mark.parametrize("layout, direction, rate, target, slowdown, limit", [
    ("llama8b-64k", "both", 94.0, 95, 0.011, "slowdown <= +1.0%"),
    ("tp8-8k", "both", 89.0, 90, 0.031, "slowdown over bulk <= +2.0%"),
    ("16k", "store", 49.0, 50, 0.021, "slowdown over bulk <= +1.0%"),
])
def test_each_layout_and_direction_has_its_targets(layout, direction, rate, target, slowdown, limit):
    got = checks([row("bulk", direction, 100.0, 0.010, layout=layout), row("pages", direction, rate, slowdown, layout=layout)])
    assert got[f"rate >= {target} GB/s"] == (False, f"{rate:.1f}, short by {target - rate:.1f}")
    assert got[limit][0] is False


def test_small_pages_are_judged_over_bulk_and_the_default_is_the_path_chosen():
    rows = [row("bulk", "load", 55.0, 0.040, layout="4k"), row("vllm_worker", "load", 5.0, 0.14, layout="4k"),
            row("pages_dma", "load", 9.0, 0.045, layout="4k"), row("pages_staged", "load", 50.0, 0.07, layout="4k")]
    got = checks(rows)  # chosen: pages_dma
    assert got["rate >= 50 GB/s"] == (False, "9.0, short by 41.0")
    assert got["slowdown over bulk <= +1.0%"] == (True, "+0.50% (bulk +4.00%)")
    assert got["slowdown <= vLLM's + 0.3%"][0] is None


def test_a_noisy_run_says_so_and_gets_no_slowdown_verdict():
    got = checks([row("bulk", "load", 55.0, 0.005, drift=0.004), row("vllm_worker", "load", 54.0, 0.001),
                  row("pages", "load", 54.0, 0.02)])
    assert got["every window's |idle drift| <= 0.3%"] == (False, "bulk +0.40%")
    assert got["slowdown <= +0.7%"][0] is None and got["slowdown <= +0.7%"][1].endswith("(noisy: no result)")
    assert got["slowdown <= vLLM's + 0.3%"][0] is None
    assert got["rate >= 53 GB/s"] == (True, "54.0")


def test_runs_are_kept_apart_by_process_and_wheel_and_runs_alone_are_not_judged():
    rows = []
    for process, wheel, rate in (("a", "x", 94.0), ("a", "y", 96.0), ("b", "x", 97.0)):
        rows += [row("bulk", "both", 100.0, 0.01, process=process, wheel=wheel),
                 row("pages", "both", rate, 0.012, process=process, wheel=wheel)]
    rows += [dict(row(m, "store", 50.0, None, process="c"), step_slowdown=None) for m in ("bulk", "pages")]
    verdicts = check_targets.check(rows)
    assert [(v.run[0], v.run[3]) for v in verdicts] == [("a", "x"), ("a", "y"), ("b", "x")]
    assert [dict((w, ok) for w, ok, _ in v.checks)["rate >= 95 GB/s"] for v in verdicts] == [False, True, True]


def test_a_kvoffload_row_naming_its_host_layout_stays_in_its_run():
    got = checks([row("bulk", "store", 55.0, 0.005, cpu_layout=None),
                  row("pages", "store", 53.5, 0.006, cpu_layout="per_tensor")])
    assert got["rate >= 53 GB/s"] == (True, "53.5")


def both_rows(rates, queues, dropped=3):
    rows = []
    for i, (rate, connections) in enumerate(zip(rates, queues)):
        for method, alone in (("bulk", 100.0), ("pages", rate)):
            rows.append(dict(row(method, "both", 0.0, None, alone=alone, process=f"p{i}", dropped_handlers=dropped,
                                 connections=connections), step_slowdown=None))
    return rows


@pytest.mark.parametrize("rates, queues, dropped, met", [
    ([95.0] * 8, ["8", "32"] * 4, 3, True),
    ([95.0] * 7 + [89.9], ["8", "32"] * 4, 3, False),  # one process short
    ([95.0] * 7, ["8", "32"] * 3 + ["8"], 3, False),  # seven processes
    ([95.0] * 8, ["32"] * 8, 3, False),  # one hardware-queue setting
    ([95.0] * 8, ["8", "32"] * 4, 2, None),  # too few dropped handlers: not such a run
])
def test_both_ways_in_every_process(rates, queues, dropped, met):
    got = check_targets.both_in_every_process(both_rows(rates, queues, dropped))
    if met is None:
        assert got == []
    else:
        ((layout, ok, figures),) = got
        assert layout == "llama8b-64k" and ok is met, figures
        assert figures.startswith(f"{sum(r >= 90 for r in rates)} of {len(rates)} processes")
