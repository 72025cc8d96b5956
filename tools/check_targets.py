"""Checks a bench/vllm_worker.py result against kvoffload's targets beside a model, one
entry per run, layout and direction, and says by how much each target is missed.

  python3 tools/check_targets.py --results=bench/results/<file>.json [--where=wheel=abc1234]

A run is one process's rows of a layout (and wheel, where rows name it; a kvoffload
row's host layout is its handler's, so it does not split a run): the default's row
(method "pages", else the forced path the default chose) is judged against the bulk
copies and vLLM's worker of the same run. Beside the prefill loop (workload "model") the
64 KiB slowdown target is the step slowdown itself, as the targets give it (vLLM's
worker's cost there); beside another loop, and at 4-16 KiB, it is over bulk copies'
slowdown. A run with a window over the noise target gets no slowdown
verdict. Both ways at once must reach BOTH_PROCESSES GB/s alone in every one of at least
BOTH_RUNS processes, at 8 and at 32 hardware queues among them, each after BOTH_DROPPED
handlers were made and dropped.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags

NOISE = 0.003  # |idle drift| of a window above which its slowdown is no result
PEER_MARGIN = 0.003  # the default may cost this much more than vLLM's worker ...
PEER_SHARE = 0.9  # ... where vLLM's worker moves at least this share of bulk copies' rate
BOTH_PROCESSES = 90.0  # GB/s both ways at once (alone), in every process
BOTH_RUNS = 8  # processes
BOTH_DROPPED = 3  # handlers made and dropped in each before the measured one


@dataclasses.dataclass(frozen=True)
class Target:
    gb_per_s: float  # beside the model, at least
    slowdown: float  # at most
    over_bulk: bool  # slowdown read over bulk copies' in the same run


_LARGE = {"store": Target(53.0, 0.007, False), "load": Target(53.0, 0.007, False),
          "both": Target(95.0, 0.010, False)}
_SMALL = {"store": Target(50.0, 0.010, True), "load": Target(50.0, 0.010, True),
          "both": Target(90.0, 0.020, True)}
TARGETS = {"llama8b-64k": _LARGE, "tp8-8k": _SMALL, "4k": _SMALL, "16k": _SMALL}


@dataclasses.dataclass
class Verdict:
    run: tuple  # (process, layout, direction, wheel, workload): None where unnamed
    checks: list[tuple[str, bool | None, str]]  # (what, met (None: not required, or noisy), figures)


def _run_key(row) -> tuple:
    return (row.get("process"), row["layout"], row["direction"], row.get("wheel"), row.get("workload"))


def _default(rows):
    """The default's row of one run: method "pages", else the forced path it chose."""
    by_method = {r["method"]: r for r in rows}
    if "pages" in by_method:
        return by_method["pages"]
    chosen = rows[0].get("chosen") or ""
    halves = set(chosen.split("/"))
    return by_method.get(halves.pop()) if len(halves) == 1 else None


def _cost(row, bulk, over_bulk: bool) -> float:
    return row["step_slowdown"] - (bulk["step_slowdown"] if over_bulk else 0.0)


def _noisy(rows) -> list[str]:
    return [f"{r['method']} {w['idle_drift']:+.2%}" for r in rows for w in r.get("windows", [])
            if abs(w["idle_drift"]) > NOISE]


def check(rows: list[dict]) -> list[Verdict]:
    """A Verdict per run whose rows were measured beside the model, in file order."""
    verdicts = []
    for key, run in _runs(rows).items():
        by_method = {r["method"]: r for r in run}
        default, bulk, peer = _default(run), by_method.get("bulk"), by_method.get("vllm_worker")
        if default is None or bulk is None:
            continue
        noisy = _noisy(run)
        checks = []
        target = TARGETS.get(key[1], {}).get(key[2])
        if target is not None:
            rate = default["gb_per_s_beside"]
            checks.append((f"rate >= {target.gb_per_s:g} GB/s", rate >= target.gb_per_s,
                           f"{rate:.1f}" + ("" if rate >= target.gb_per_s else f", short by {target.gb_per_s - rate:.1f}")))
            over_bulk = target.over_bulk or key[4] not in (None, "model")
            cost = _cost(default, bulk, over_bulk)
            what = f"slowdown{' over bulk' if over_bulk else ''} <= {target.slowdown:+.1%}"
            checks.append((what, None if noisy else cost <= target.slowdown, f"{cost:+.2%}" + (
                "" if cost <= target.slowdown else f", over by {cost - target.slowdown:.2%}") +
                f" (bulk {bulk['step_slowdown']:+.2%})" + (" (noisy: no result)" if noisy else "")))
        if peer is not None:
            for field, name in (("gb_per_s", "alone"), ("gb_per_s_beside", "beside")):
                ours, theirs = default[field], peer[field]
                checks.append((f">= vLLM's worker's rate {name}", ours >= theirs, f"{ours:.1f} against {theirs:.1f}"))
            share = peer["gb_per_s_beside"] / bulk["gb_per_s_beside"] if bulk["gb_per_s_beside"] else 0.0
            limit = peer["step_slowdown"] + PEER_MARGIN
            required = share >= PEER_SHARE
            checks.append((f"slowdown <= vLLM's + {PEER_MARGIN:.1%}",
                           default["step_slowdown"] <= limit if required and not noisy else None,
                           f"{default['step_slowdown']:+.2%} against {peer['step_slowdown']:+.2%}, vLLM's worker at "
                           f"{share:.0%} of bulk beside" + ("" if required else " (not required)") +
                           (" (noisy: no result)" if noisy and required else "")))
        checks.append((f"every window's |idle drift| <= {NOISE:.1%}", not noisy, ", ".join(noisy) or "all"))
        verdicts.append(Verdict(key, checks))
    return verdicts


def both_in_every_process(rows: list[dict]) -> list[tuple[str, bool, str]]:
    """Per layout: (layout, met, figures): the default moved >= BOTH_PROCESSES GB/s both
    ways at once, alone, in every one of at least BOTH_RUNS processes that each dropped
    BOTH_DROPPED handlers first, at 8 and at 32 hardware queues among them."""
    rates: dict[str, dict] = {}
    for key, run in _runs(rows, "both", beside=False).items():
        default = _default(run)
        if default is not None and (default.get("dropped_handlers") or 0) >= BOTH_DROPPED:
            rates.setdefault(key[1], {}).setdefault(key[0], []).append(default)
    out = []
    for layout, by_process in rates.items():
        lowest = {p: min(r["gb_per_s"] for r in got) for p, got in by_process.items()}
        queues = {r.get("connections") for got in by_process.values() for r in got}
        good = sum(rate >= BOTH_PROCESSES for rate in lowest.values())
        ok = good == len(lowest) >= BOTH_RUNS and {"8", "32"} <= queues
        out.append((layout, ok, f"{good} of {len(lowest)} processes at {sorted(queues, key=str)} hardware queues, "
                                f"the lowest {min(lowest.values()):.3f} GB/s"))
    return out


def _runs(rows, direction=None, beside=True) -> dict[tuple, list[dict]]:
    """The rows by run (of one direction, if given; only those measured beside the model,
    with ``beside``)."""
    runs: dict[tuple, list[dict]] = {}
    for row in rows:
        if (not beside or row.get("step_slowdown") is not None) and direction in (None, row["direction"]):
            runs.setdefault(_run_key(row), []).append(row)
    return runs


FLAGS = flags.FLAGS
flags.DEFINE_string("results", None, "A bench/vllm_worker.py JSON file.")
flags.DEFINE_string("where", "", "Only rows with this key=value (for example wheel=606b7c7).")


def main(argv):
    del argv
    if not FLAGS.results:
        raise app.UsageError("--results: a bench/vllm_worker.py JSON file")
    with open(FLAGS.results) as f:
        rows = json.load(f)["rows"]
    if FLAGS.where:
        key, value = FLAGS.where.split("=", 1)
        rows = [r for r in rows if str(r.get(key)) == value]
    met = total = 0
    for verdict in check(rows):
        process, layout, direction, *rest = verdict.run
        print(f"{layout} {direction} ({', '.join(str(v) for v in (process, *rest) if v is not None)})")
        for what, ok, figures in verdict.checks:
            print(f"  {'met   ' if ok else 'missed' if ok is False else '-     '} {what}: {figures}")
            met, total = met + bool(ok), total + (ok is not None)
    for layout, ok, figures in both_in_every_process(rows):
        print(f"{layout}, both ways at once in every process")
        print(f"  {'met   ' if ok else 'missed'} >= {BOTH_PROCESSES:g} GB/s alone in each of >= {BOTH_RUNS} processes "
              f"after {BOTH_DROPPED} dropped handlers, at 8 and 32 hardware queues: {figures}")
        met, total = met + ok, total + 1
    print(f"{met} of {total} checks met")


if __name__ == "__main__":
    app.run(main)
