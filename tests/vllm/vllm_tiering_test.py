"""kvoffload.vllm.KVOffloadTieringSpec: vLLM 0.33's tiering (its manager, CPU primary tier
and fs secondary tier, unchanged) with kvoffload's worker on vLLM's SharedOffloadRegion,
driven on CPU tensors (the handler's host lanes)."""

import dataclasses
import os
import re
import threading
import time

import numpy as np
import pytest
import torch

import vllm_env
from kv_model import interrupt_first_wait
from vllm_cache import POISON, VllmCache, canonical_page, finish, job, tp2_mapping

if vllm_env.LIGHT:
    pytest.skip("the light vLLM bundle has no vllm.config", allow_module_level=True)
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
                                     CanonicalPageMapping, CopyRun, GPULoadStoreSpec, LookupResult,
                                     ReqContext, ScheduleEndContext, make_offload_key)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

import kvoffload.vllm
from kvoffload.vllm.region_worker import KVOffloadRegionWorker
from kvoffload.vllm.tiering import KVOffloadTieringSpec

BPC = 2
# Three tensors of different pages: a chunk row is 2 * (1024 + 1024 + 2048) = 8 KiB.
ROWS, REFS = [1024, 1024, 2048], [[(0, 1024), (1, 1024), (2, 2048)]]
# A hybrid model: two groups referencing the same tensors (vLLM's shared KV tensors).
HYBRID = [[(0, 1024), (1, 1024), (2, 2048)], [(0, 1024), (1, 1024), (2, 2048)]]
NUM_BLOCKS = 64


def engine_id():
    return f"kvoffload-tiering-test-{os.getpid()}-{time.monotonic_ns()}"


def extra(root_dir, **more):
    config = {"spec_name": "KVOffloadTieringSpec", "spec_module_path": "kvoffload.vllm",
              "cpu_bytes_to_use": 64 * 8192, "secondary_tiers": [{"type": "fs", "root_dir": str(root_dir)}]}
    return {**config, **more}


def config(extra_config, rows=ROWS, groups=1, world_size=1, rank=0, worker_bytes=None, bpc=BPC,
           engine=None, **flags):
    parallel = OffloadingParallelConfig(
        rank=rank, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=False)
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(16, (f"layer.{g}",), g) for g in range(groups)),
        worker_kv_bytes_per_block=sum(rows) if worker_bytes is None else worker_bytes,
        enable_kv_cache_events=False, extra_config=dict(extra_config), engine_id=engine or engine_id(),
        model=OffloadingModelConfig("model", "int8"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc), parallel=parallel, **flags)


def region_path(spec):
    return f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap"


def expected_row(cache, blocks, skip=0):
    """Chunk row bytes vLLM's region holds for these GPU blocks (sub-blocks from ``skip``):
    per tensor, its blocks_per_chunk pages; None where nothing is stored."""
    row = []
    for t, page in zip(cache.tensors, ROWS):
        pages = [None] * BPC
        for j, b in enumerate(blocks):
            pages[skip + j] = t[b, :page].numpy().view(np.uint8)
        row.append(pages)
    return row


def assert_row(row_bytes, expected, what):
    """row_bytes (uint8, one chunk row of the region) holds ``expected``'s pages."""
    at = 0
    for t, (pages, page) in enumerate(zip(expected, ROWS)):
        for j, want in enumerate(pages):
            if want is not None:
                assert np.array_equal(row_bytes[at + j * page:at + (j + 1) * page], want), \
                    f"{what}: tensor {t} sub-block {j} differs"
        at += BPC * page


def test_the_factory_selects_the_spec_and_the_pool_is_the_region(tmp_path):
    spec = OffloadingSpecFactory.create_spec(config(extra(tmp_path)))
    assert type(spec) is KVOffloadTieringSpec and isinstance(spec, TieringOffloadingSpec)
    assert kvoffload.vllm.KVOffloadTieringSpec is KVOffloadTieringSpec
    manager = spec.get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    assert [type(t) for t in manager.secondary_tiers] == [FileSystemTierManager]
    cache = VllmCache(np.random.default_rng(0), ROWS, REFS, NUM_BLOCKS)
    worker = spec.get_worker(cache.kv_caches)
    assert isinstance(worker, KVOffloadRegionWorker) and spec.get_worker(None) is worker
    region, views = worker.region, worker.region_views
    # The handler's pool is the worker's mapping of the region, every tensor where vLLM's view is.
    assert worker.handler.pool.base == region.base_tensor.data_ptr() == views[0].data_ptr()
    assert worker.handler.pool.nbytes == region.total_size_bytes == spec.num_chunks * 8192
    assert [(t.cpu_base, t.cpu_stride) for t in worker.handler.layout.groups[0].tensors] == \
        [(v.data_ptr(), v.stride(0)) for v in views]
    assert worker.handler.layout.groups[0].num_cpu_chunks == spec.num_chunks == 64
    del region, views
    region = worker.region
    worker.shutdown()
    assert worker.region is None
    assert region.mmap_obj is None, "a view of the region outlived the worker: vLLM kept it mapped"
    manager.shutdown()
    assert not os.path.exists(region_path(spec))


LINKED = r"is a symbolic link or a second link to a file"


@pytest.mark.parametrize("plant", ["mode 0644", "another owner", "a symbolic link", "a hard link"])
def test_a_region_file_another_user_could_have_planted_is_refused_and_left_unwritten(tmp_path, monkeypatch, plant):
    spec = OffloadingSpecFactory.create_spec(config(extra(tmp_path)))
    path = region_path(spec)
    # What the region's name leads to: the file itself, or a file of this user it links to.
    planted = {"a symbolic link": str(tmp_path / "victim"), "a hard link": f"{path}.victim"}.get(plant, path)
    poison = bytes([POISON % 256]) * (spec.num_chunks * 8192)
    with open(os.open(planted, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as f:
        f.write(poison)
    owner, me = os.geteuid(), os.geteuid() + 4242
    try:
        if plant == "a symbolic link":
            os.symlink(planted, path)
        elif plant == "a hard link":
            os.link(planted, path)
        elif plant == "mode 0644":
            os.chmod(path, 0o644)
        else:  # this process becomes another user: the file is no longer its own
            monkeypatch.setattr(os, "geteuid", lambda: me)
        why = {"mode 0644": r"has mode 0644, wider than 0600", "a symbolic link": LINKED, "a hard link": LINKED,
               "another owner": rf"is owned by uid {owner}, not by this user \(uid {me}\)"}[plant]
        cache = VllmCache(np.random.default_rng(0), ROWS, REFS, NUM_BLOCKS)
        with pytest.raises(PermissionError, match=rf"{re.escape(path)} {why}.*; refusing vLLM's shared region"):
            spec.get_worker(cache.kv_caches)
        with open(planted, "rb") as f:
            assert f.read() == poison
    finally:
        for name in {path, planted} - {str(tmp_path / "victim")}:
            os.unlink(name)


@pytest.mark.parametrize("plant", ["an empty file of mode 0666", "a FIFO"])
def test_a_planted_file_vllm_would_wait_on_is_refused_before_vllm_opens_it(tmp_path, plant):
    # vLLM's region, joining an existing file, waits 30 s for it to grow, then raises its
    # TimeoutError; at a FIFO it blocks in open().
    spec = OffloadingSpecFactory.create_spec(config(extra(tmp_path)))
    path = region_path(spec)
    if plant == "a FIFO":
        os.mkfifo(path, 0o600)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.chmod(path, 0o666)
    try:
        why = "is a FIFO, not a regular file" if plant == "a FIFO" else "has mode 0666, wider than 0600"
        cache = VllmCache(np.random.default_rng(0), ROWS, REFS, NUM_BLOCKS)
        with pytest.raises(PermissionError, match=rf"{re.escape(path)} {why}.*; refusing vLLM's shared region"):
            spec.get_worker(cache.kv_caches)
        assert os.stat(path).st_size == 0
    finally:
        os.unlink(path)


@pytest.mark.parametrize("grows", [False, True], ids=["a crashed engine's smaller file", "a file being sized"])
def test_a_smaller_region_file_is_refused_unless_its_creator_sizes_it(tmp_path, monkeypatch, grows):
    from kvoffload.vllm import tiering
    monkeypatch.setattr(tiering, "STALE_SECONDS", 0.3 if not grows else 3.0)
    spec = OffloadingSpecFactory.create_spec(config(extra(tmp_path)))
    path, size = region_path(spec), spec.num_chunks * spec.kv_bytes_per_chunk
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    sizer = threading.Timer(0.1, os.ftruncate, (fd, size)) if grows else None
    try:
        cache = VllmCache(np.random.default_rng(0), ROWS, REFS, NUM_BLOCKS)
        if sizer is None:
            started = time.monotonic()
            with pytest.raises(PermissionError, match=rf"{re.escape(path)} holds 4096 bytes, fewer than the "
                                                      rf"{size} of this engine's region, and has not grown"):
                spec.get_worker(cache.kv_caches)
            assert time.monotonic() - started < 5 and os.fstat(fd).st_size == 4096
        else:
            sizer.start()
            worker = spec.get_worker(cache.kv_caches)  # joins the file its creator sized
            assert worker.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([3]))
            worker.wait({1})
            worker.shutdown()
    finally:
        if sizer is not None:
            sizer.join()
        os.close(fd)
        if os.path.exists(path):
            os.unlink(path)


def test_a_smaller_region_file_changed_in_the_future_is_refused_without_waiting_for_then(tmp_path, monkeypatch):
    from kvoffload.vllm import tiering
    monkeypatch.setattr(tiering, "STALE_SECONDS", 0.3)
    spec = OffloadingSpecFactory.create_spec(config(extra(tmp_path)))
    path = region_path(spec)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        now = time.time
        monkeypatch.setattr(tiering.time, "time", lambda: now() - 1000)  # the file's ctime: 1000 s ahead
        started = time.monotonic()
        with pytest.raises(PermissionError, match="holds 4096 bytes, fewer than"):
            spec.get_worker(VllmCache(np.random.default_rng(0), ROWS, REFS, NUM_BLOCKS).kv_caches)
        assert time.monotonic() - started < 5
    finally:
        os.close(fd)
        os.unlink(path)


def test_an_interrupted_shutdown_keeps_the_region_for_the_jobs_and_a_second_one_releases_it(tmp_path, monkeypatch):
    spec = OffloadingSpecFactory.create_spec(config(extra(tmp_path)))
    cache = VllmCache(np.random.default_rng(0), ROWS, REFS, NUM_BLOCKS)
    worker = spec.get_worker(cache.kv_caches)
    assert worker.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([3]))
    interrupt_first_wait(monkeypatch, worker.handler)
    with pytest.raises(KeyboardInterrupt):
        worker.shutdown()
    assert worker.region is not None and os.path.exists(region_path(spec))
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    region = worker.region
    worker.shutdown()
    assert worker.region is None and region.mmap_obj is None
    spec.get_manager().shutdown()
    assert not os.path.exists(region_path(spec))


def test_a_second_engine_under_the_same_id_with_another_region_size_is_refused(tmp_path):
    # The first engine's region is this user's and private, so only its size tells it
    # apart: joined, both engines would write the same chunks.
    first = OffloadingSpecFactory.create_spec(config(extra(tmp_path)))
    cache = VllmCache(np.random.default_rng(0), ROWS, REFS, NUM_BLOCKS)
    worker = first.get_worker(cache.kv_caches)
    try:
        worker.region.base_tensor.view(torch.uint8).fill_(POISON & 0xFF)
        second = OffloadingSpecFactory.create_spec(config(extra(tmp_path, cpu_bytes_to_use=32 * 8192),
                                                          engine=first.config.engine_id))
        other = VllmCache(np.random.default_rng(1), ROWS, REFS, NUM_BLOCKS)
        with pytest.raises(PermissionError, match=rf"{re.escape(region_path(first))} holds {64 * 8192} bytes, "
                                                  rf"not the {32 * 8192} of this engine's region"):
            second.get_worker(other.kv_caches)
        assert (worker.region.base_tensor.view(torch.uint8) == POISON & 0xFF).all()
    finally:
        worker.shutdown()
        first.get_manager().shutdown()


@pytest.mark.parametrize("refs", [REFS, HYBRID], ids=["one group", "hybrid: two groups share tensors"])
@pytest.mark.parametrize("seed", [0, 1])
def test_stores_land_in_the_rows_the_tiers_read_and_load_back(tmp_path, refs, seed):
    rng = np.random.default_rng(seed)
    spec = KVOffloadTieringSpec(config(extra(tmp_path), groups=len(refs)))
    manager = spec.get_manager()
    # What the secondary tiers read: the scheduler side's own mapping of the region.
    tier_view = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(
        spec.num_chunks, -1)
    cache = VllmCache(rng, ROWS, refs, NUM_BLOCKS)
    worker = spec.get_worker(cache.kv_caches)
    n = [int(rng.integers(5, 10)) for _ in refs]
    blocks = rng.permutation(NUM_BLOCKS)
    src = [blocks[sum(n[:g]):sum(n[:g + 1])] for g in range(len(refs))]
    dst = [blocks[sum(n) + sum(n[:g]):sum(n) + sum(n[:g + 1])] for g in range(len(refs))]
    first = [int(rng.integers(0, BPC)) for _ in refs]  # some stores start inside a chunk
    used = [(f + k + BPC - 1) // BPC for f, k in zip(first, n)]
    chunk_ids = rng.permutation(spec.num_chunks)
    chunks = [chunk_ids[sum(used[:g]):sum(used[:g + 1])] for g in range(len(refs))]
    tier_view[:] = POISON & 0xFF  # so that a row kvoffload did not write cannot pass
    snapshot = cache.snapshot()
    gpu, cpu = job(src, first, chunks, BPC)
    started = time.perf_counter()
    assert worker.submit_store(1, gpu, cpu)
    assert finish(worker, {1}, started)[1].transfer_size == sum(n) * sum(ROWS)
    for g in range(len(refs)):
        for c in range(used[g]):
            lo = max(0, c * BPC - first[g])
            hi = min(n[g], (c + 1) * BPC - first[g])
            skip = first[g] if c == 0 else 0
            assert_row(tier_view[chunks[g][c]], expected_row(cache, src[g][lo:hi], skip),
                       f"group {g} chunk {c}")
    load_back(worker, cache, snapshot, src, dst, first, chunks, BPC)
    worker.shutdown()
    del tier_view
    manager.shutdown()


def load_back(worker, cache, snapshot, src, dst, first, chunks, bpc):
    """Loads the chunks stored from src[g] into other, poisoned blocks dst[g]."""
    for g in range(len(dst)):
        cache.poison(g, dst[g])
    gpu, cpu = job(dst, first, chunks, bpc)
    started = time.perf_counter()
    assert worker.submit_load(2, cpu, gpu)
    finish(worker, {2}, started)
    for g in range(len(dst)):
        cache.assert_blocks(snapshot, g, src[g], dst[g])


def schedule_end(manager):
    manager.on_schedule_end(ScheduleEndContext((), ()))


def settle(manager, done, timeout=60.0):
    """Runs scheduler steps until done() holds (under the manager's lock)."""
    started = time.perf_counter()
    while True:
        with manager.lock:
            schedule_end(manager)
            if done():
                return
        assert time.perf_counter() - started < timeout, "the tiers never settled"
        time.sleep(0.005)


def test_a_chunk_goes_to_disk_through_vllms_fs_tier_and_comes_back_to_the_gpu(tmp_path):
    rng = np.random.default_rng(7)
    spec = KVOffloadTieringSpec(config(extra(tmp_path)))
    manager = spec.get_manager()
    tier = manager.secondary_tiers[0]
    tier_view = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(
        spec.num_chunks, -1)
    cache = VllmCache(rng, ROWS, REFS, NUM_BLOCKS)
    worker = spec.get_worker(cache.kv_caches)
    keys = [make_offload_key(rng.bytes(16), 0) for _ in range(4)]
    src, dst = np.split(rng.permutation(NUM_BLOCKS)[:2 * BPC * len(keys)], 2)
    snapshot = cache.snapshot()

    # vLLM's scheduler side allocates the chunks, kvoffload's worker stores into them, and
    # complete_store cascades them to the fs tier, which writes them from the region.
    request = ReqContext("request-0")
    with manager.lock:
        manager.on_new_request(request)
        out = manager.prepare_store(keys, request)
    assert list(out.keys_to_store) == keys
    started = time.perf_counter()
    assert worker.submit_store(1, GPULoadStoreSpec(src.tolist(), [len(src)], [0]), out.store_spec)
    finish(worker, {1}, started)
    with manager.lock:
        manager.complete_store(keys, request)
        manager.on_request_finished(request)
    settle(manager, lambda: not manager.has_pending_work())
    for k, key in enumerate(keys):
        path = tier.file_mapper.get_file_name(key)
        with open(path, "rb") as f:
            on_disk = np.frombuffer(f.read(), dtype=np.uint8)
        assert on_disk.size == tier_view.shape[1], path
        assert_row(on_disk, expected_row(cache, src[k * BPC:(k + 1) * BPC]), f"{path} (chunk {k})")

    # The CPU tier forgets them and its memory is overwritten: only the disk has them now.
    with manager.lock:
        manager.reset_cache()
        manager.on_reset_flushed()
    tier_view[:] = POISON & 0xFF
    cache.poison(0, dst)

    # A new request finds them on disk; vLLM's fs tier promotes them into the region.
    request = ReqContext("request-1")
    with manager.lock:
        manager.on_new_request(request)
    lookups = []
    settle(manager, lambda: lookups.append([manager.lookup(k, request) for k in keys])
           or lookups[-1] == [LookupResult.HIT] * len(keys))
    assert LookupResult.HIT not in lookups[0], "the CPU tier still had them"
    with manager.lock:
        load_spec = manager.prepare_load(keys, request)
    assert isinstance(load_spec, CPULoadStoreSpec)
    for k, c in enumerate(load_spec.chunk_ids):
        assert_row(tier_view[c], expected_row(cache, src[k * BPC:(k + 1) * BPC]), f"promoted chunk {k}")
    started = time.perf_counter()
    assert worker.submit_load(2, load_spec, GPULoadStoreSpec(dst.tolist(), [len(dst)], [0]))
    assert finish(worker, {2}, started)[2].transfer_size == len(dst) * sum(ROWS)
    cache.assert_blocks(snapshot, 0, src, dst)
    with manager.lock:
        manager.complete_load(keys, request)
        manager.on_request_finished(request)
    worker.shutdown()
    del tier_view
    manager.shutdown()
    assert not os.path.exists(region_path(spec))


def test_a_job_outside_the_region_is_refused_naming_the_vllm_field(tmp_path):
    spec = KVOffloadTieringSpec(config(extra(tmp_path)))
    cache = VllmCache(np.random.default_rng(3), ROWS, REFS, NUM_BLOCKS)
    worker = spec.get_worker(cache.kv_caches)
    with pytest.raises(ValueError, match=r"submit_store\(job_id=1\): .*dst_spec\.block_ids"):
        worker.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([spec.num_chunks]))
    assert worker.get_finished() == []
    worker.shutdown()
    assert not os.path.exists(region_path(spec))  # the worker made the file, and removed it


@pytest.mark.parametrize("make, message", [
    (lambda d: (config(extra(d)), ROWS, [[(0, 1024), (1, 1000), (2, 2048)]]),
     r"kv_caches\.group_data_refs\[0\]\[1\]\.page_size_bytes: 1000 is less than "
     r"kv_caches\.tensors\[1\]\.page_size_bytes=1024"),
    (lambda d: (config(extra(d), worker_bytes=2048), ROWS, REFS),
     r"kv_caches\.tensors: 3 tensors of page_size_bytes \[1024, 1024, 2048\] need 8192 bytes per chunk, "
     r"more than the 4096 of this worker's slot in a row of vLLM's region \(OffloadingConfig\.worker_kv_bytes_per_block"),
    (lambda d: (config(extra(d)), ROWS, [[(3, 1024)]]),
     r"kv_caches\.group_data_refs\[0\]\[0\]\.tensor_idx: 3 is out of range \[0, 3\)"),
    (lambda d: (config(extra(d, kvoffload_cpu_layout="per_tensor")), ROWS, REFS),
     r"kv_connector_extra_config: kvoffload_cpu_layout='per_tensor' cannot be given: the layout is that of "
     r"vLLM's SharedOffloadRegion"),
    (lambda d: (config(extra(d, cpu_bytes_to_use=4096)), ROWS, REFS),
     r"kv_connector_extra_config: cpu_bytes_to_use=4096 holds no chunk of 8192 bytes"),
    (lambda d: (config(extra(d), canonical_layout=True), ROWS, REFS),
     r"kv_connector_extra_config: canonical_layout=True needs one GPU block per offloaded block"),
])
def test_caches_the_region_cannot_hold_are_refused_naming_the_field(tmp_path, caplog, make, message):
    cfg, rows, refs = make(tmp_path)
    spec = KVOffloadTieringSpec(cfg)
    cache = VllmCache(np.random.default_rng(5), rows, refs, NUM_BLOCKS)
    with pytest.raises(ValueError, match=message):
        spec.get_worker(cache.kv_caches)
    assert spec._worker is None
    assert not os.path.exists(region_path(spec))  # the refused worker's region is gone...
    assert "Keeping" not in caplog.text  # ...and unmapped: no view of it was left behind


def check_round_trip(rng, spec, cache, refs, bpc=BPC, rank_views=None):
    """A store of random blocks lands where vLLM's own worker views have each page (row c of
    the region, sub-block j), and loads back into other, poisoned blocks."""
    manager = spec.get_manager()
    tier_view = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(
        spec.num_chunks, -1)
    worker = spec.get_worker(cache.kv_caches)
    region_base = worker.region.base_tensor.data_ptr()
    n = [int(rng.integers(3, 8)) for _ in refs]
    blocks = rng.permutation(NUM_BLOCKS)
    src = [blocks[sum(n[:g]):sum(n[:g + 1])] for g in range(len(refs))]
    dst = [blocks[sum(n) + sum(n[:g]):sum(n) + sum(n[:g + 1])] for g in range(len(refs))]
    used = [(k + bpc - 1) // bpc for k in n]
    chunk_ids = rng.permutation(spec.num_chunks)
    chunks = [chunk_ids[sum(used[:g]):sum(used[:g + 1])] for g in range(len(refs))]
    tier_view[:] = POISON & 0xFF
    snapshot = cache.snapshot()
    started = time.perf_counter()
    assert worker.submit_store(1, *job(src, [0] * len(refs), chunks, bpc))
    finish(worker, {1}, started)
    for g, group in enumerate(refs):
        for i, page in group:
            at = worker.region_views[i].data_ptr() - region_base  # in vLLM's row
            for k, b in enumerate(src[g]):
                c, j = chunks[g][k // bpc], k % bpc
                assert np.array_equal(tier_view[c, at + j * page:at + (j + 1) * page],
                                      snapshot[i][b, :page].numpy().view(np.uint8)), (g, i, k)
    load_back(worker, cache, snapshot, src, dst, [0] * len(refs), chunks, bpc)
    worker.shutdown()
    del tier_view
    manager.shutdown()


@pytest.mark.parametrize("make", [
    # Two ranks' slots side by side in each row: this worker's is the second.
    lambda d: (config(extra(d), world_size=2, rank=1), ROWS, REFS),
    # A row of 2 * 3 * 96 bytes, which vLLM rounds up to 4 KiB.
    lambda d: (config(extra(d), rows=[96] * 3), [96] * 3, [[(0, 96), (1, 96), (2, 96)]]),
    # A tensor no group references keeps its place in vLLM's row.
    lambda d: (config(extra(d)), ROWS, [[(0, 1024), (2, 2048)]]),
    # Tensors referenced in another order than vLLM's row has them.
    lambda d: (config(extra(d)), ROWS, [[(1, 1024), (0, 1024), (2, 2048)]]),
], ids=["second rank's slot", "row rounded up", "unreferenced tensor", "refs out of row order"])
def test_caches_laid_out_otherwise_in_the_region_go_where_vllms_views_have_them(tmp_path, make):
    cfg, rows, refs = make(tmp_path)
    spec = KVOffloadTieringSpec(cfg)
    check_round_trip(np.random.default_rng(9), spec, VllmCache(np.random.default_rng(4), rows, refs, NUM_BLOCKS), refs)


def canonical_caches(rng, mappings):
    """Two layers of 1024-byte local pages, each ref with ``mappings[layer]``."""
    tensors = [torch.from_numpy(rng.integers(-128, 128, (NUM_BLOCKS, 1024), dtype=np.int8)) for _ in mappings]
    return tensors, CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, 1024) for t in tensors],
        [[CanonicalKVCacheRef(i, 1024, m) for i, m in enumerate(mappings)]])


def test_canonical_pages_are_the_ranks_fragments_side_by_side_and_load_back(tmp_path):
    rng = np.random.default_rng(12)
    engine = engine_id()
    cfgs = [config(extra(tmp_path), world_size=2, rank=r, bpc=1, worker_bytes=2048, engine=engine,
                   canonical_layout=True, kv_cache_layout="LBNHC") for r in range(2)]
    specs = [KVOffloadTieringSpec(c) for c in cfgs]
    manager = specs[0].get_manager()
    tier_view = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(
        specs[0].num_chunks, -1)
    tier_view[:] = POISON & 0xFF
    caches = [canonical_caches(np.random.default_rng(20 + r), [tp2_mapping(r)] * 2) for r in range(2)]
    workers = [s.get_worker(c) for s, (_, c) in zip(specs, caches)]
    assert [len(g) for g in workers[0].handler.gpu_tensors] == [2 * 2 * 4], "a tensor per fragment"
    blocks = rng.permutation(NUM_BLOCKS)[:6]
    chunks = rng.permutation(specs[0].num_chunks)[:6]
    snapshots = [[t.clone() for t in tensors] for tensors, _ in caches]
    for r, w in enumerate(workers):
        started = time.perf_counter()
        assert w.submit_store(r, GPULoadStoreSpec(blocks.tolist(), [6], [0]), CPULoadStoreSpec(chunks.tolist()))
        assert finish(w, {r}, started)[r].transfer_size == 6 * 2 * 1024
    for k, (b, c) in enumerate(zip(blocks, chunks)):
        for layer in range(2):
            want = canonical_page([snapshots[r][layer][b].numpy().view(np.uint8) for r in range(2)],
                                  [tp2_mapping(r) for r in range(2)], 2048)
            assert np.array_equal(tier_view[c, layer * 2048:(layer + 1) * 2048], want), (k, layer)
    targets = rng.permutation(NUM_BLOCKS)[:6]
    for r, w in enumerate(workers):
        for t in caches[r][0]:
            t[torch.as_tensor(targets)] = POISON
        started = time.perf_counter()
        assert w.submit_load(10 + r, CPULoadStoreSpec(chunks.tolist()), GPULoadStoreSpec(targets.tolist(), [6], [0]))
        finish(w, {10 + r}, started)
        for layer, t in enumerate(caches[r][0]):
            assert torch.equal(t[torch.as_tensor(targets)], snapshots[r][layer][torch.as_tensor(blocks)]), (r, layer)
    for w in workers:
        w.shutdown()
    del tier_view
    manager.shutdown()


def test_where_ranks_hold_the_same_bytes_each_stores_the_blocks_vllm_elects_it_for(tmp_path):
    # An MLA-like layer: the whole 1024-byte page, the same on both ranks, written by rank
    # chunk % 2. Here the ranks' pages differ, so the region shows who wrote each chunk.
    rng = np.random.default_rng(13)
    engine = engine_id()
    mla = [CanonicalPageMapping(1024, 1024, (CopyRun(0, 0, 1024, 1, 1024, 1024),), 2, r, True) for r in range(2)]
    specs = [KVOffloadTieringSpec(config(extra(tmp_path), world_size=2, rank=r, bpc=1, worker_bytes=1024,
                                         engine=engine, canonical_layout=True, kv_cache_layout="LBNHC")) for r in range(2)]
    manager = specs[0].get_manager()
    tier_view = np.frombuffer(manager.primary_tier.get_kv_memoryview(), dtype=np.uint8).reshape(
        specs[0].num_chunks, -1)
    tier_view[:] = POISON & 0xFF
    caches = [canonical_caches(np.random.default_rng(30 + r), [mla[r]]) for r in range(2)]
    workers = [s.get_worker(c) for s, (_, c) in zip(specs, caches)]
    blocks = rng.permutation(NUM_BLOCKS)[:8]
    chunks = rng.permutation(specs[0].num_chunks)[:8]
    for r, w in enumerate(workers):
        started = time.perf_counter()
        assert w.submit_store(r, GPULoadStoreSpec(blocks.tolist(), [8], [0]), CPULoadStoreSpec(chunks.tolist()))
        mine = sum(int(c) % 2 == r for c in chunks)
        assert finish(w, {r}, started)[r].transfer_size == mine * 1024
    for b, c in zip(blocks, chunks):
        writer = int(c) % 2
        assert np.array_equal(tier_view[c, :1024], caches[writer][0][0][b].numpy().view(np.uint8)), (b, c)
    for w in workers:
        w.shutdown()
    del tier_view
    manager.shutdown()


def tp2_specs(tmp_path, **more):
    engine = engine_id()
    return [KVOffloadTieringSpec(config(extra(tmp_path, **more), world_size=2, rank=r, bpc=1, worker_bytes=2048,
                                        engine=engine, canonical_layout=True, kv_cache_layout="LBNHC"))
            for r in range(2)]


@pytest.mark.parametrize("mapping, message", [
    (CanonicalPageMapping(2048, 1024, (CopyRun(0, 0, 128, 4, 128, 256), CopyRun(512, 1920, 128, 4, 128, 256)),
                          1, 0, True),
     r"kv_caches\.group_data_refs\[0\]\[0\]\.mapping\.runs\[1\]: its last fragment ends at byte 2816 of "
     r"the canonical page, which has 2048"),
    (CanonicalPageMapping(2048, 1024, (CopyRun(0, 0, 128, 4, 128, 256), CopyRun(1024, 1024, 128, 4, 128, 256)),
                          1, 0, True),
     r"\.mapping\.runs\[1\]: its last fragment ends at byte 1536 of the local page, which has 1024"),
    (CanonicalPageMapping(2048, 1024, (CopyRun(0, -64, 128, 4, 128, 256),), 1, 0, True),
     r"\.mapping\.runs\[0\]\.canonical_offset: expected an int >= 0, got -64"),
    (CanonicalPageMapping(2048, 512, (CopyRun(0, 0, 128, 4, 128, 256),), 1, 0, True),
     r"\.mapping\.local_page_size_bytes: 512 is not the ref's page_size_bytes=1024"),
    (dataclasses.replace(tp2_mapping(0), num_writers=0), r"\.mapping\.num_writers: expected an int >= 1, got 0"),
    (dataclasses.replace(tp2_mapping(0), num_writers=2, writer_index=5),
     r"\.mapping\.writer_index: expected an int in \[0, 2\), got 5"),
    (dataclasses.replace(tp2_mapping(0), num_writers=2, writer_index=-1),
     r"\.mapping\.writer_index: expected an int in \[0, 2\), got -1"),
])
def test_canonical_mappings_that_leave_their_pages_are_refused_naming_the_run(tmp_path, caplog, mapping, message):
    spec = tp2_specs(tmp_path)[0]
    _, caches = canonical_caches(np.random.default_rng(1), [mapping, tp2_mapping(0)])
    with pytest.raises(ValueError, match=message):
        spec.get_worker(caches)
    assert spec._worker is None and not os.path.exists(region_path(spec))
    assert "Keeping" not in caplog.text


def test_groups_mapping_one_tensor_differently_are_refused_naming_both_refs(tmp_path):
    spec = tp2_specs(tmp_path)[0]
    tensor = torch.zeros((NUM_BLOCKS, 1024), dtype=torch.int8)
    split = CanonicalPageMapping(2048, 1024, (CopyRun(0, 0, 512, 1, 512, 512), CopyRun(512, 1024, 512, 1, 512, 512)),
                                 1, 0, True)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(tensor, 1024)],
                               [[CanonicalKVCacheRef(0, 1024, tp2_mapping(0))], [CanonicalKVCacheRef(0, 1024, split)]])
    with pytest.raises(ValueError, match=r"kv_caches\.group_data_refs\[1\]\[0\]\.mapping: its runs differ from "
                                         r"those of kv_caches\.group_data_refs\[0\]\[0\]"):
        spec.get_worker(caches)


def test_a_handler_refused_inside_leaves_no_view_of_the_region_mapped(tmp_path, caplog):
    spec = KVOffloadTieringSpec(config(extra(tmp_path, kvoffload_method="bogus")))
    cache = VllmCache(np.random.default_rng(2), ROWS, REFS, NUM_BLOCKS)
    with pytest.raises(ValueError, match=r"method: expected one of"):
        spec.get_worker(cache.kv_caches)
    assert not os.path.exists(region_path(spec))
    assert "Keeping" not in caplog.text


@pytest.mark.parametrize("blocks, chunks, message", [
    ([0, 1], [-1, 2], r"dst_spec\.block_ids\[0\] = -1 is out of range"),
    ([0, 1], [3, 5, 6], r"dst_spec\.block_ids: has 3 ids but the groups use 2 chunks"),
    ([0, 10 ** 6], [2, 3], r"src_spec\.block_ids\[1\] = 1000000 is out of range"),
    ([0, 1], [3, 3], r"dst_spec\.block_ids\[1\] = 3 appears twice"),
])
def test_every_writer_refuses_a_bad_store_whatever_blocks_it_writes(tmp_path, blocks, chunks, message):
    mla = [CanonicalPageMapping(1024, 1024, (CopyRun(0, 0, 1024, 1, 1024, 1024),), 2, r, True) for r in range(2)]
    engine = engine_id()
    specs = [KVOffloadTieringSpec(config(extra(tmp_path), world_size=2, rank=r, bpc=1, worker_bytes=1024,
                                         engine=engine, canonical_layout=True, kv_cache_layout="LBNHC"))
             for r in range(2)]
    workers = [s.get_worker(canonical_caches(np.random.default_rng(r), [mla[r]])[1]) for r, s in enumerate(specs)]
    for w in workers:
        with pytest.raises(ValueError, match=r"submit_store\(job_id=7\): .*" + message):
            w.submit_store(7, GPULoadStoreSpec(blocks, [len(blocks)], [0]), CPULoadStoreSpec(chunks))
        assert w.get_finished() == []
    for w in workers:
        w.shutdown()
