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


def test_a_large_page_run_is_judged_on_its_slowdown_and_against_vllms_worker():
    got = checks([row("bulk", "store", 55.0, 0.005), row("vllm_worker", "store", 52.0, 0.004, alone=54.0),
                  row("pages", "store", 53.5, 0.008, alone=53.0)])
    assert got["rate >= 53 GB/s"] == (True, "53.5")
    assert got["slowdown <= +0.7%"] == (False, "+0.80%, over by 0.10% (bulk +0.50%)")
    assert got[">= vLLM's worker's rate alone"] == (False, "53.0 against 54.0")
    assert got[">= vLLM's worker's rate beside"] == (True, "53.5 against 52.0")
    assert got["slowdown <= vLLM's + 0.3%"] == (False, "+0.80% against +0.40%, vLLM's worker at 95% of bulk")
    assert got["every window's |idle drift| <= 0.3%"] == (True, "all")


def test_small_pages_are_judged_over_bulk_and_the_peer_rule_only_where_vllm_keeps_up():
    rows = [row("bulk", "load", 55.0, 0.040, layout="4k", drift=0.004), row("vllm_worker", "load", 5.0, 0.14, layout="4k"),
            row("pages_dma", "load", 9.0, 0.045, layout="4k"), row("pages_staged", "load", 50.0, 0.07, layout="4k")]
    got = checks(rows)  # the default is the path chosen: pages_dma
    assert got["rate >= 50 GB/s"] == (False, "9.0, short by 41.0")
    assert got["slowdown over bulk <= +1.0%"] == (True, "+0.50% (bulk +4.00%)")
    assert got["slowdown <= vLLM's + 0.3%"][0] is None
    assert got["every window's |idle drift| <= 0.3%"] == (False, "bulk +0.40%")


def test_runs_are_kept_apart_by_process_and_rows_alone_only_are_not_judged():
    rows = [row("bulk", "both", 100.0, 0.01, process=p) for p in ("a", "b")]
    rows += [row("pages", "both", 94.0, 0.012, process="a"), row("pages", "both", 96.0, 0.012, process="b")]
    rows.append(dict(row("pages", "store", 50.0, None), step_slowdown=None))
    verdicts = check_targets.check(rows)
    assert [v.run[0] for v in verdicts] == ["a", "b"]
    rates = [dict((w, ok) for w, ok, _ in v.checks)["rate >= 95 GB/s"] for v in verdicts]
    assert rates == [False, True]


@pytest.mark.parametrize("alone, good", [((95.0, 89.9), 1), ((95.0, 90.0), 2)])
def test_both_ways_in_every_process_counts_processes_alone(alone, good):
    rows = []
    for process, rate in zip(("a", "b"), alone):
        rows += [dict(row("bulk", "both", 0.0, None, alone=100.0, process=process), step_slowdown=None),
                 dict(row("pages", "both", 0.0, None, alone=rate, process=process, dropped_handlers=3,
                          connections="8"), step_slowdown=None)]
    assert check_targets.both_in_every_process(rows) == {"llama8b-64k": (good, 2, [(3, "8")])}
