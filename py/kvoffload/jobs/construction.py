"""What making an OffloadHandler checks and builds before it has lanes: its arguments, each
error naming the argument; its GPU tensors registered; its pool made (or the caller's
host_buffer taken), registered and laid out."""

from __future__ import annotations

import hashlib
import json
from typing import Iterable

from ..copy.registry import tensor_span
from ..copy.writable import require_writable
from ..pages.planner import KVLayout
from ..pool.host_pool import HostPool, PoolOptions
from ..pool.layout import check_places, chunk_runs, kv_layout, pool_bytes, tensor_owners
from ..util.arguments import is_int, require_int
from ..util.vocabulary import MemoryKind


def check_options(torch, host_buffer, host_pool, expedited_loads, cpu_layout, cpu_places) -> None:
    """The options that need no other argument: their types, and the pairs that exclude each other."""
    if host_buffer is not None and not isinstance(host_buffer, torch.Tensor):
        raise TypeError(f"host_buffer: expected a CPU torch tensor, got {type(host_buffer).__name__}")
    if host_pool is not None and not isinstance(host_pool, PoolOptions):
        raise TypeError(f"host_pool: expected a kvoffload.PoolOptions, got {type(host_pool).__name__}")
    if host_pool is not None and host_buffer is not None:
        raise ValueError("host_pool: options of a pool the handler makes; with host_buffer the pool is the "
                         "caller's, page-locked as it is")
    if not isinstance(expedited_loads, bool):
        raise TypeError(f"expedited_loads: expected True or False, got {expedited_loads!r}")
    if cpu_places is not None and cpu_layout is not None:
        raise ValueError(f"cpu_layout: {cpu_layout!r} cannot be given with cpu_places, which place the chunks")


def tensor_groups(torch, gpu_tensors) -> list[list]:
    """gpu_tensors as lists of tensors, one per group; TypeError naming what is not."""
    def groups_of(value, name):
        if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Iterable):
            raise TypeError(f"{name}: expected a sequence, got a {type(value).__name__}")
        return list(value)

    groups = [groups_of(group, f"gpu_tensors[{g}]") for g, group in enumerate(groups_of(gpu_tensors, "gpu_tensors"))]
    for g, group in enumerate(groups):
        for i, t in enumerate(group):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"gpu_tensors[{g}][{i}]: expected a torch tensor, got a {type(t).__name__}")
            # The bytes in memory are not the values such a tensor shows.
            for bit, resolve in (("is_conj", "resolve_conj"), ("is_neg", "resolve_neg")):
                if getattr(t, bit)():
                    raise ValueError(f"gpu_tensors[{g}][{i}]: has its {bit[3:]} bit set; pass "
                                     f"tensor.{resolve}(), which holds its values in memory")
    return groups


def one_device(gpu_tensors):
    devices = {t.device for group in gpu_tensors for t in group}
    if not devices:
        raise ValueError(f"gpu_tensors: no tensors in its {len(gpu_tensors)} groups")
    if len(devices) != 1:
        raise ValueError(f"gpu_tensors: expected one device, got {sorted(map(str, devices))}")
    return devices.pop()


def chunks_per_group(num_cpu_chunks, groups: int) -> list[int]:
    if is_int(num_cpu_chunks):
        num_cpu_chunks = [num_cpu_chunks] * groups
    if not isinstance(num_cpu_chunks, Iterable):
        raise TypeError(f"num_cpu_chunks: expected an int or one per group, got "
                        f"{type(num_cpu_chunks).__name__}")
    num_cpu_chunks = [require_int(f"num_cpu_chunks[{g}]", n, 0) for g, n in enumerate(num_cpu_chunks)]
    if len(num_cpu_chunks) != groups:
        raise ValueError(f"num_cpu_chunks: has {len(num_cpu_chunks)} entries for {groups} groups")
    return num_cpu_chunks


def register_gpu_tensors(registry, gpu_tensors) -> None:
    """Every view is registered (its own span: a tensor's views in several groups may
    differ, A[:, :32] and A), once: a tensor referenced by several groups again is only
    watched, so that a storage swapped under any reference is refused."""
    registered = set()
    require_writable((f"gpu_tensors[{g}][{i}]", *tensor_span(t)) for g, group in enumerate(gpu_tensors)
                     for i, t in enumerate(group) if t.device.type == "cpu")
    for g, group in enumerate(gpu_tensors):
        for i, t in enumerate(group):
            if t.numel():
                view = (str(t.device), t.data_ptr(), tuple(t.shape), t.stride())
                if view in registered:
                    registry.watch(f"gpu_tensors[{g}][{i}]", t)
                else:
                    registered.add(view)
                    registry.register_tensor(f"gpu_tensors[{g}][{i}]", t)


def pool_tag(pages, num_cpu_chunks, blocks_per_chunk, cpu_layout, owners) -> str:
    """What a pool of this layout holds, in a few words and a digest of the whole: handlers
    that share a pool by name (shm_name) must agree on it. Of the owners only which
    references share a tensor counts: each rank has its own GPU addresses."""
    first = {}
    shared = [[first.setdefault(owner, (g, i)) for i, owner in enumerate(group)] for g, group in enumerate(owners)]
    whole = json.dumps([pages, num_cpu_chunks, blocks_per_chunk, cpu_layout, shared], default=int)
    digest = hashlib.sha256(whole.encode()).hexdigest()[:16]
    tensors = sum(len(group) for group in pages)
    return (f"kvoffload pool {digest}: {len(pages)} groups, {tensors} tensors, chunks {num_cpu_chunks} "
            f"of {blocks_per_chunk} blocks, {cpu_layout}")[:1024]


def pool_and_layout(registry, gpu_tensors, pages, num_cpu_chunks, blocks_per_chunk, cpu_layout,
                     host_buffer, cpu_places, options, device) -> tuple[HostPool, KVLayout]:
    """The pool (made here, or the caller's host_buffer), registered, and the layout of
    its chunks: cpu_layout's, or the caller's cpu_places in host_buffer."""
    owners = tensor_owners(gpu_tensors)
    if cpu_places is None:
        need = pool_bytes(pages, num_cpu_chunks, blocks_per_chunk, owners)
        runs = chunk_runs(pages, num_cpu_chunks, blocks_per_chunk, cpu_layout, owners)
    elif host_buffer is None:
        raise ValueError("cpu_places: places chunks in a host_buffer, and none was given")
    else:  # the buffer is registered whole: no runs to respect
        cpu_places, need = check_places(cpu_places, pages, num_cpu_chunks, blocks_per_chunk,
                                        host_buffer.numel() * host_buffer.element_size())
        runs = ()
    pool = HostPool(need, buffer=host_buffer, pinned=device.type == "cuda", device=device.index or 0,
                    options=options, chunk_runs=runs,
                    layout=pool_tag(pages, num_cpu_chunks, blocks_per_chunk, cpu_layout, owners))
    try:
        shared = registry.overlapping(*tensor_span(pool.tensor))  # all of a host_buffer
        if shared:
            raise ValueError(f"host_buffer: overlaps {shared[0].name}")
        if pool.nbytes:
            registry.register("host pool", pool.base, pool.nbytes, MemoryKind.HOST)
        if host_buffer is not None:
            registry.watch("host_buffer", host_buffer)  # held, and refused if swapped
        if cpu_places is None:
            layout = kv_layout(gpu_tensors, pages, num_cpu_chunks, blocks_per_chunk, pool.base, cpu_layout)
        else:
            layout = KVLayout.from_parts(
                gpu_tensors, pages, [[(pool.base + o, s) for o, s in group] for group in cpu_places],
                num_cpu_chunks, blocks_per_chunk)
    except BaseException:
        pool.release()  # a host_buffer page-locked here is unlocked again
        raise
    return pool, layout
