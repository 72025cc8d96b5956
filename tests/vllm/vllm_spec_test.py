"""kvoffload.vllm.KVOffloadSpec: selected through vLLM's factory, sized by vLLM's CPU
spec, its worker driven by vLLM's scheduler-side manager and by vLLM's connector worker."""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import vllm_env
from vllm_cache import VllmCache, finish

if vllm_env.LIGHT:
    pytest.skip("the light vLLM bundle has no vllm.config", allow_module_level=True)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata, TransferJob)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

import kvoffload as kv
from kvoffload.vllm import KVOffloadSpec, KVOffloadWorker
from kvoffload.vllm.spec import handler_options, shared_pool_name

BPC = 2
ROWS, REFS = [256, 256], [[(0, 256), (1, 256)]]
EXTRA = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm", "cpu_bytes_to_use": 1 << 20}


def config(extra=EXTRA, world_size=1, rank=0, engine_id="engine-0", **flags):
    parallel = OffloadingParallelConfig(
        rank=rank, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=False)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),), worker_kv_bytes_per_block=sum(ROWS),
        enable_kv_cache_events=False, extra_config=dict(extra), engine_id=engine_id,
        model=OffloadingModelConfig("model", "int8"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BPC), parallel=parallel, **flags)


def test_the_factory_selects_the_spec_and_vllm_sizes_the_pool():
    spec = OffloadingSpecFactory.create_spec(config())
    assert type(spec) is KVOffloadSpec
    assert spec.num_chunks == CPUOffloadingSpec(config()).num_chunks > 0
    worker = spec.get_worker(VllmCache(np.random.default_rng(0), ROWS, REFS, 8).kv_caches)
    assert isinstance(worker, KVOffloadWorker) and spec.get_worker(None) is worker
    assert worker.handler.layout.groups[0].num_cpu_chunks == spec.num_chunks
    worker.shutdown()


def ranks_in_one_process(monkeypatch, ranks=2, timeout=60):
    """Ranks made in this process share a pool name as a TP group would (rank 0's) and wait
    for each other as its barrier does: make their workers together (in_threads)."""
    names = []
    barrier = threading.Barrier(ranks, timeout=timeout)

    def share(spec, name):
        names.append(name)
        return names[0]

    monkeypatch.setattr(KVOffloadSpec, "_share_pool_name", share)
    monkeypatch.setattr(KVOffloadSpec, "_ranks_attached", lambda spec: barrier.wait())
    return names


def in_threads(calls):
    """Each call on a thread of its own, together; their results in order."""
    results, errors = [None] * len(calls), []

    def run(i):
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_replicated_layout_shares_one_pool_rank_0_stores_every_rank_loads(monkeypatch):
    # What vLLM's own spec sizes on a GPU (where its region is shared): one copy for all ranks.
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)
    names = ranks_in_one_process(monkeypatch)
    engine = f"engine {os.getpid()}/{time.monotonic_ns()}"  # odd characters on purpose
    ranks = [KVOffloadSpec(config(world_size=2, rank=r, engine_id=engine, replicated_layout=True))
             for r in range(2)]
    assert all(spec.replicated_layout for spec in ranks)
    assert ranks[0].num_chunks == CPUOffloadingSpec(config(world_size=2, replicated_layout=True)).num_chunks
    assert [OffloadingConnectorWorker(spec, None, None)._is_store_writer for spec in ranks] == [True, False]
    name = shared_pool_name(engine)
    assert "/" not in name and " " not in name

    rng = np.random.default_rng(4)
    caches = [VllmCache(rng, ROWS, REFS, num_blocks=32) for _ in ranks]
    workers = in_threads([lambda s=spec, c=cache: s.get_worker(c.kv_caches) for spec, cache in zip(ranks, caches)])
    # Both ranks attached to rank 0's name: the engine's name and a secret no one can guess.
    assert len(names) == 2 and names[0] != names[1] and all(n.startswith(name + "-") for n in names)
    name = names[0]
    # Once both had mapped it the file lost its name: a killed engine leaves nothing behind.
    assert not os.path.exists(f"/dev/shm/{name}")
    assert workers[0].handler.pool.base != workers[1].handler.pool.base  # two mappings of one file
    src, dst = np.split(rng.permutation(32)[:16], 2)
    chunks = rng.permutation(ranks[0].num_chunks)[:4].tolist()
    started = time.perf_counter()
    assert workers[0].submit_store(1, GPULoadStoreSpec(src.tolist(), [8], [0]), CPULoadStoreSpec(chunks))
    finish(workers[0], {1}, started)
    caches[1].poison(0, dst)
    assert workers[1].submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst.tolist(), [8], [0]))
    finish(workers[1], {2}, started)
    # Rank 1's blocks now hold what rank 0 stored (its own tensors never went to the pool).
    for i, page in REFS[0]:
        assert torch.equal(caches[1].tensors[i][torch.as_tensor(dst), :page],
                           caches[0].tensors[i][torch.as_tensor(src), :page])
    for worker in workers:
        worker.shutdown()
    assert not os.path.exists(f"/dev/shm/{name}")  # the last one out removed it


def test_a_rank_whose_worker_fails_releases_the_others_and_rank_0_removes_a_killed_engines_file(monkeypatch):
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)
    # What an engine killed before its ranks had all mapped the pool leaves: a named file
    # of this user that no one holds.
    left = f"/dev/shm/{shared_pool_name(f'killed-{os.getpid()}')}-{'0' * 32}"
    unnamed = f"/dev/shm/.kvoffload-{os.getpid()}-killed-while-made.tmp"  # killed before it had its name
    for path in (left, unnamed):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 4096)
        os.close(fd)
    ranks_in_one_process(monkeypatch, timeout=30)
    engine = f"engine-{os.getpid()}-{time.monotonic_ns()}"
    ranks = [KVOffloadSpec(config(world_size=2, rank=r, engine_id=engine, replicated_layout=True))
             for r in range(2)]
    rng = np.random.default_rng(5)
    good = VllmCache(rng, ROWS, REFS, num_blocks=32)
    refused = VllmCache(rng, ROWS, [[(0, 256), (1, 300)]], num_blocks=32)  # a page past its row
    outcomes = [None, None]

    def make(rank, cache):
        try:
            outcomes[rank] = ranks[rank].get_worker(cache.kv_caches)
        except BaseException as e:  # noqa: BLE001 - checked below
            outcomes[rank] = e

    threads = [threading.Thread(target=make, args=(r, c)) for r, c in enumerate([good, refused])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Rank 1 failed on its own error and still joined the barrier: rank 0 went on (without
    # the release it would have waited out the barrier and got BrokenBarrierError).
    assert isinstance(outcomes[1], ValueError), outcomes[1]
    assert isinstance(outcomes[0], KVOffloadWorker), outcomes[0]
    assert not os.path.exists(left) and not os.path.exists(unnamed)
    outcomes[0].shutdown()


def test_canonical_layout_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"kv_connector_extra_config: canonical_layout=True: vLLM keeps canonical pages only in its tiering spec's region; use \"spec_name\": \"KVOffloadTieringSpec\""):
        KVOffloadSpec(config(canonical_layout=True))


def test_manager_prepares_a_store_then_an_expedited_load():
    rng = np.random.default_rng(1)
    cache = VllmCache(rng, ROWS, REFS, num_blocks=32)
    spec = KVOffloadSpec(config())
    manager, worker = spec.get_manager(), spec.get_worker(cache.kv_caches)
    request = ReqContext("request-0")
    manager.on_new_request(request)
    keys = [make_offload_key(bytes([k]) * 16, 0) for k in range(5)]
    with manager.lock:
        out = manager.prepare_store(keys, request)
    assert out.keys_to_store == keys and isinstance(out.store_spec, CPULoadStoreSpec)
    src, dst = np.split(rng.permutation(32)[:20], 2)
    snapshot = cache.snapshot()
    started = time.perf_counter()
    assert worker.submit_store(1, GPULoadStoreSpec(src.tolist(), [10], [0]), out.store_spec)
    assert finish(worker, {1}, started)[1].transfer_size == 10 * sum(ROWS)
    with manager.lock:
        manager.complete_store(keys, request)
        assert [manager.lookup(k, request) for k in keys] == [LookupResult.HIT] * 5
        load_spec = manager.prepare_load(keys[1:], request)
    cache.poison(0, dst)
    started = time.perf_counter()
    assert worker.submit_load(2, load_spec, GPULoadStoreSpec(dst[2:].tolist(), [8], [2]), expedited=True)
    worker.wait({2})
    assert finish(worker, {2}, started)[2].transfer_size == 8 * sum(ROWS)
    cache.assert_blocks(snapshot, 0, src[2:], dst[2:])
    with manager.lock:
        manager.complete_load(keys[1:], request)
    worker.shutdown()


def test_vllm_connector_worker_defers_stores_flushes_loads_and_reports_stats():
    rng = np.random.default_rng(2)
    cache = VllmCache(rng, ROWS, REFS, num_blocks=32)
    spec = KVOffloadSpec(config())
    connector = OffloadingConnectorWorker(spec, None, None)
    connector._init_worker(cache.kv_caches)  # what register_kv_caches ends with
    blocks = rng.permutation(32)
    chunks = rng.permutation(spec.num_chunks)
    gpu = lambda k: GPULoadStoreSpec(blocks[4 * k:4 * k + 4].tolist(), [4], [0])
    cpu = lambda k: CPULoadStoreSpec(chunks[2 * k:2 * k + 2].tolist())
    store = lambda k: TransferJob(f"r{k}", gpu(k), cpu(k))
    meta = lambda loads, stores, flush=None: OffloadingConnectorMetadata(loads, stores, flush)
    snapshot = cache.snapshot()

    connector.start_kv_transfers(meta({}, {}))
    connector.prepare_store_kv(meta({}, {1: store(0)}))
    assert connector.worker.get_finished() == []  # deferred to the next step
    connector.start_kv_transfers(meta({}, {}))
    connector.prepare_store_kv(meta({}, {2: store(1)}))
    connector.handle_preemptions(meta({}, {3: store(2)}, flush={3}))
    connector.worker.wait({1, 2})
    cache.poison(0, blocks[12:20])
    connector.start_kv_transfers(meta({4: TransferJob("r4", cpu(0), gpu(3)),
                                       5: TransferJob("r5", cpu(1), gpu(4), sync=True)}, {}))
    cache.assert_blocks(snapshot, 0, blocks[4:8], blocks[16:20])  # sync: done at once
    received, started = set(), time.perf_counter()
    while received != {"r4"}:
        assert time.perf_counter() - started < 60
        sending, recving = connector.get_finished(set())
        assert sending == set()
        received |= recving
    cache.assert_blocks(snapshot, 0, blocks[0:4], blocks[12:16])
    connector.get_finished(set())
    report = connector.build_connector_worker_meta()
    assert report.completed_jobs == {k: 1 for k in range(1, 6)}
    stats = report.transfer_stats
    assert stats.store.bytes == 3 * 4 * sum(ROWS) and stats.load.bytes == 2 * 4 * sum(ROWS)
    assert stats.store.time > 0 and stats.load.time > 0
    connector.shutdown()


def test_the_worker_needs_only_vllms_light_modules():
    heavy = ["vllm.config", "vllm.distributed", "vllm.v1.kv_offload.cpu.spec", "vllm.platforms"]
    code = (f"import sys, kvoffload.vllm; heavy = {heavy!r}; "
            "print(sorted(h for h in heavy if h in sys.modules)); kvoffload.vllm.KVOffloadSpec; "
            "print(sorted(h for h in heavy if h in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", repr(sorted(heavy))]


def test_vllm_connector_flushes_a_preemption_on_every_rank_of_a_replicated_layout(monkeypatch):
    # vLLM's own connector worker on two ranks sharing one pool: rank 1 skips the stores
    # (only rank 0 writes the shared pool) and then waits for the flushed ids it never saw,
    # as vLLM's handle_preemptions does; it must return, and load what rank 0 stored.
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)
    ranks_in_one_process(monkeypatch)
    engine = f"engine-flush-{os.getpid()}-{time.monotonic_ns()}"
    ranks = [KVOffloadSpec(config(world_size=2, rank=r, engine_id=engine, replicated_layout=True))
             for r in range(2)]
    rng = np.random.default_rng(7)
    caches = [VllmCache(rng, ROWS, REFS, num_blocks=32) for _ in ranks]
    connectors = [OffloadingConnectorWorker(spec, None, None) for spec in ranks]
    assert [c._is_store_writer for c in connectors] == [True, False]
    in_threads([lambda c=connector, k=cache: c._init_worker(k.kv_caches) for connector, cache in zip(connectors, caches)])
    blocks = rng.permutation(32)
    chunks = rng.permutation(ranks[0].num_chunks)[:4].tolist()
    stores = {10: TransferJob("r0", GPULoadStoreSpec(blocks[0:4].tolist(), [4], [0]), CPULoadStoreSpec(chunks[:2])),
              11: TransferJob("r1", GPULoadStoreSpec(blocks[4:8].tolist(), [4], [0]), CPULoadStoreSpec(chunks[2:]))}
    meta = lambda loads, store_jobs, flush=None: OffloadingConnectorMetadata(loads, store_jobs, flush)
    for connector in connectors:  # step 1: job 10 deferred; step 2: 11 flushed with it (preemption)
        connector.start_kv_transfers(meta({}, {}))
        connector.prepare_store_kv(meta({}, {10: stores[10]}))
    for connector in connectors:
        connector.handle_preemptions(meta({}, {11: stores[11]}, flush={10, 11}))
    # Both flushed stores are in the shared pool now: rank 1 loads them (a sync load waits).
    dst = blocks[8:16]
    caches[1].poison(0, dst)
    connectors[1].start_kv_transfers(meta(
        {12: TransferJob("r2", CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst.tolist(), [8], [0]), sync=True)}, {}))
    for i, page in REFS[0]:
        assert torch.equal(caches[1].tensors[i][torch.as_tensor(dst), :page],
                           caches[0].tensors[i][torch.as_tensor(blocks[:8]), :page])
    for connector in connectors:
        connector.get_finished(set())
    reports = [c.build_connector_worker_meta().completed_jobs for c in connectors]
    assert reports == [{10: 1, 11: 1}, {10: 1, 11: 1, 12: 1}]
    for connector in connectors:
        connector.shutdown()


def test_the_extra_keys_become_handler_options_and_max_slowdown_belongs_to_pages_and_auto():
    assert handler_options({"kvoffload_method": "pages_dma", "kvoffload_cpu_layout": "per_tensor", "block_size": 32}) \
        == {"method": "pages_dma", "cpu_layout": "per_tensor"}
    assert handler_options({"kvoffload_method": "auto", "kvoffload_max_slowdown": 0.05}) \
        == {"method": kv.Auto(0.05)}
    assert handler_options({"kvoffload_max_slowdown": 0.01}) == {"method": kv.Pages(max_slowdown=0.01)}
    with pytest.raises(ValueError, match="kvoffload_max_slowdown is an option of \"kvoffload_method\": \"pages\" "
                                         "or \"auto\", got method 'pages_dma'"):
        handler_options({"kvoffload_method": "pages_dma", "kvoffload_max_slowdown": 0.05})
    with pytest.raises(ValueError, match="kvoffload_max_slowdown: max_slowdown: must be a number >= 0"):
        handler_options({"kvoffload_max_slowdown": -0.01})
    with pytest.raises(ValueError, match="kvoffload_max_slowdown: max_slowdown: must be a number >= 0"):
        handler_options({"kvoffload_method": "auto", "kvoffload_max_slowdown": "fast"})
    with pytest.raises(ValueError, match="kvoffload_max_slowdown: max_slowdown: must be a number >= 0"):
        handler_options({"kvoffload_method": "auto", "kvoffload_max_slowdown": True})


@pytest.mark.parametrize("key", ["kvoffload_metod", "kvoffload_cpu_layot", "kvoffload_shm_name", "kvoffload_"])
def test_an_unknown_kvoffload_key_is_refused_not_dropped(key):
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config: '{key}' is no kvoffload option; expected one "
                                         r"of \['kvoffload_method', 'kvoffload_cpu_layout', 'kvoffload_max_slowdown'\]"):
        handler_options({key: "pages_dma", "block_size": 32})


@pytest.mark.parametrize("extra, message", [
    ({"kvoffload_method": "PAGES"}, r"kv_connector_extra_config: kvoffload_method: method: expected one of"),
    ({"kvoffload_method": None}, r"kv_connector_extra_config: kvoffload_method: method: expected one of"),
    ({"kvoffload_method": ["pages"]}, r"kv_connector_extra_config: kvoffload_method: method: expected one of"),
    ({"kvoffload_cpu_layout": "bogus"}, r"kv_connector_extra_config: kvoffload_cpu_layout: expected one of "
                                        r"\['chunk_major', 'per_tensor'\], got 'bogus'"),
])
def test_bad_kvoffload_values_name_their_key_before_a_pool_is_made(extra, message):
    assert handler_options({"kvoffload_cpu_layout": None}) == {"cpu_layout": None}  # JSON null: the default
    with pytest.raises(ValueError, match=message):
        handler_options(extra)
    spec = OffloadingSpecFactory.create_spec(config({**EXTRA, **extra}))
    with pytest.raises(ValueError, match=message):
        spec.get_worker(VllmCache(np.random.default_rng(0), ROWS, REFS, 8).kv_caches)


@pytest.mark.parametrize("cpu_bytes", [1, -(1 << 20)])
def test_cpu_bytes_that_hold_no_chunk_are_named(cpu_bytes):
    spec = OffloadingSpecFactory.create_spec(config({**EXTRA, "cpu_bytes_to_use": cpu_bytes}))
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config: cpu_bytes_to_use={cpu_bytes} holds no chunk"):
        spec.get_worker(VllmCache(np.random.default_rng(0), ROWS, REFS, 8).kv_caches)


def test_wait_after_shutdown_returns_as_vllms_worker_does():
    spec = OffloadingSpecFactory.create_spec(config())
    worker = spec.get_worker(VllmCache(np.random.default_rng(0), ROWS, REFS, 8).kv_caches)
    worker.shutdown()
    worker.wait({1})
    worker.wait(set())
    assert worker.get_finished() == []


def test_a_tensor_whose_first_dimension_is_not_its_blocks_is_refused_naming_it():
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    tensor = torch.zeros((8, 128), dtype=torch.int8)  # 16 pages of 64 bytes
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(tensor, 64)], [[CanonicalKVCacheRef(0, 64)]])
    with pytest.raises(ValueError, match=r"kv_caches\.tensors\[0\]: \(8, 128\) torch\.int8 tensor holds 16 pages "
                                         r"of page_size_bytes=64, not one per index of its first dimension"):
        KVOffloadWorker(caches, BPC, 4)
