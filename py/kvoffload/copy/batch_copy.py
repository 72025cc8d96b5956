"""Batch copies between GPU and host memory: the Python face of ``kvoffload._C``.

Pointer arrays are 1-D int64 arrays in host memory (numpy, torch) or sequences of
ints. The pointer calls take ``registry``: a kvoffload.MemoryRegistry that every copy
must lie inside (checked before anything is copied, ValueError naming the copy and the
region it missed), or ``kvoffload.UNCHECKED`` to copy wherever the pointers say.
``stream`` is None (the legacy default stream), an int handle, or a stream object
(``__cuda_stream__`` or ``cuda_stream``, as torch.cuda.Stream has). Every
argument is checked before anything is copied; a bad one raises TypeError or
ValueError naming it, and a failing CUDA call raises CudaError with the CUDA error
name.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np

from .. import _C
from ..util.arguments import require_int
from ..util.vocabulary import Direction, MemoryKind
from .registry import require_registry, tensor_span
from .writable import require_writable

CudaError = _C.CudaError
NoCudaDeviceError = _C.NoCudaDeviceError
SrcAccessOrder = _C.SrcAccessOrder
CopyResult = _C.CopyResult

Int64Array = Union[Sequence[int], Any]  # a 1-D int64 host array or a sequence of ints
Stream = Any  # None, an int handle, or a stream object
Orders = Union[SrcAccessOrder, int, Int64Array]


def copy_arguments(registry, src, dst, sizes):
    """The first step of every raw-pointer call, whatever its method: ``registry``'s type
    (the MemoryRegistry, or None for UNCHECKED), then src, dst and sizes validated and
    read once (kvoffload._C: 1-D int64 host arrays, C-contiguous, of one length, or
    sequences of ints; pointers and sizes positive). So a bad argument raises the same
    error, naming it, in every mode."""
    checked = require_registry(registry)
    return (checked,) + tuple(_C.copy_arrays(src, dst, sizes))


def _checked(registry, src, dst, sizes, src_kind=None, dst_kind=None):
    """copy_arguments(), then the arrays checked against the registry: the copy gets the
    arrays that were checked."""
    checked, src, dst, sizes = copy_arguments(registry, src, dst, sizes)
    if checked is not None:
        checked.check_copies(src, dst, sizes, src_kind, dst_kind)
    return src, dst, sizes


# The copies' defaults, as the C++ option structs define them.
KERNEL_CTAS = _C.KERNEL_CTAS
PIECE_BYTES = _C.PIECE_BYTES
STAGED_SLOT_BYTES, STAGED_SLOTS, STAGED_CTAS = _C.STAGED_SLOT_BYTES, _C.STAGED_SLOTS, _C.STAGED_CTAS


def batch_copy(
    src: Int64Array,
    dst: Int64Array,
    sizes: Int64Array,
    stream: Stream = None,
    order: Orders = SrcAccessOrder.STREAM,
    per_copy: bool = False,
    *,
    registry,
    _max_copies_per_call: int = 0,
) -> CopyResult:
    """Enqueues ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` on ``stream``.

    Uses the driver's cuMemcpyBatchAsync, or one cudaMemcpyAsync per copy when the
    stream is the legacy default stream, the driver lacks the batch call or answers
    "not supported", or ``per_copy`` is set; ``result.path`` and ``result.reason``
    say which. ``order`` is one SrcAccessOrder for all copies or one per copy;
    ANY is safe only when nothing in flight writes the source. Driver calls take at most
    ``_C.COPIES_PER_DRIVER_CALL`` copies each (the driver's time per copy grows with the
    copies in one call; tests set ``_max_copies_per_call``, 0: that default).
    """
    src, dst, sizes = _checked(registry, src, dst, sizes)
    return _C.batch_copy(src, dst, sizes, stream, order, _max_copies_per_call, per_copy)


def kernel_copy(
    src: Int64Array,
    dst: Int64Array,
    sizes: Int64Array,
    stream: Stream = None,
    max_ctas: int = KERNEL_CTAS,
    *,
    registry,
    _piece_bytes: int = PIECE_BYTES,
) -> CopyResult:
    """Copies with an SM kernel of at most ``max_ctas`` CTAs of 1024 threads.

    Both ends of every copy must be memory of the stream's device or page-locked host
    memory (read through the GPU's mapping, over PCIe); pageable host memory is refused
    with a ValueError. Large copies are split into pieces that warps share.
    Descriptors reach the GPU in stream order.
    """
    src, dst, sizes = _checked(registry, src, dst, sizes)
    return _C.kernel_copy(src, dst, sizes, stream, max_ctas, _piece_bytes)


def staged_copy(
    src: Int64Array,
    dst: Int64Array,
    sizes: Int64Array,
    direction: Direction | str | None = None,
    stream: Stream = None,
    slot_bytes: int = STAGED_SLOT_BYTES,
    slots: int = STAGED_SLOTS,
    max_ctas: int = STAGED_CTAS,
    *,
    registry,
) -> CopyResult:
    """Copies between scattered device blocks and host memory in large runs, through a
    device staging ring: DMA of the host runs, plus a gather or scatter kernel.

    ``direction``: a Direction, "load" (host -> device) or "store". The ring has ``slots``
    slots of ``slot_bytes``; slices pipeline, and any batch size wraps around the ring.
    The host side must be page-locked, the device side the stream's device's (ValueError).
    """
    if direction is None:
        raise TypeError("direction: missing (a Direction, 'load' or 'store')")
    direction = Direction.parse(direction, "direction")
    src, dst, sizes = _checked(registry, src, dst, sizes, *direction.kinds)
    return _C.staged_copy(src, dst, sizes, direction.native, stream, slot_bytes, slots, max_ctas)


def host_copy(src: Int64Array, dst: Int64Array, sizes: Int64Array, threads: int = 0, *,
              registry) -> CopyResult:
    """Copies host memory to host memory with memcpy; needs no GPU.

    Large batches (``_HOST_THREADING_BYTES``) are split over ``threads`` threads
    (0: the core count, at most 8; never more than ``MAX_HOST_THREADS``). Ranges must
    not overlap. A thread that cannot be started raises RuntimeError, nothing copied.
    """
    threads = min(require_int("threads", threads, 0), MAX_HOST_THREADS)
    src, dst, sizes = _checked(registry, src, dst, sizes, MemoryKind.HOST, MemoryKind.HOST)
    return _C.host_copy(src, dst, sizes, threads)


def copy_blocks(
    src: Any,
    dst: Any,
    block_mapping: Any,
    stream: Stream = None,
    order: Orders = SrcAccessOrder.STREAM,
    *,
    _max_copies_per_call: int = 0,
) -> CopyResult:
    """Copies block ``block_mapping[i, 0]`` of ``src`` to block ``block_mapping[i, 1]`` of ``dst``.

    ``src`` and ``dst`` are DLPack tensors (torch, numpy, cupy) in host or CUDA memory,
    of one dtype and equal shape past dim 0; a block is one index of dim 0 and must be
    contiguous. ``block_mapping`` is an ``[N, 2]`` int64 host array. Every block id is
    bounds-checked and no destination block may appear twice. Two host tensors take
    the host path; otherwise the copies go through ``batch_copy``. The tensors are the
    registered memory here: no copy leaves them. A CUDA tensor must be on the stream's
    device. Torch tensors with the conjugate or negative bit set are refused, as torch's
    own DLPack export refuses them: their memory does not hold the values they show.
    """
    for name, tensor in (("src", src), ("dst", dst)):
        for bit, resolve in (("is_conj", "resolve_conj"), ("is_neg", "resolve_neg")):
            if getattr(tensor, bit, lambda: False)():
                raise ValueError(f"{name}: has its {bit[3:]} bit set; call {resolve}() first")
        if isinstance(tensor, np.ndarray):  # what DLPack cannot carry, said plainly
            if not tensor.dtype.isnative:
                raise TypeError(f"{name}: dtype {tensor.dtype.str} is not in this machine's byte order, "
                                "which DLPack needs; convert it with .astype(dtype.newbyteorder('='))")
            if tensor.dtype.fields is not None or tensor.dtype.kind in "OSUVM":
                raise TypeError(f"{name}: dtype {tensor.dtype} has no DLPack type; view the bytes as uint8")
    _require_writable_host(dst)
    return _C.copy_blocks(src, dst, block_mapping, stream, order, _max_copies_per_call)


def _require_writable_host(dst) -> None:
    """A host ``dst`` (torch or numpy) over read-only memory is refused by name: a copy
    writing it would fault."""
    if isinstance(dst, np.ndarray):
        if not dst.flags.writeable:
            return  # _C.copy_blocks refuses it: a DLPack tensor marked read-only
        low, high = _byte_bounds(dst)
        span = (low, high - low)
    elif hasattr(dst, "data_ptr") and getattr(dst, "device", None) is not None and dst.device.type == "cpu":
        try:
            span = tensor_span(dst)
        except ValueError:
            return  # _C.copy_blocks names what is wrong with it
    else:
        return
    require_writable([("dst", *span)])


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds
    return bounds(array)


def stream_device(stream: Stream) -> int:
    """The CUDA device ``stream`` belongs to."""
    return _C.stream_device(stream)


def load_kernels(device: int) -> None:
    """Loads kvoffload's kernels on ``device`` now. CUDA loads a kernel lazily, at its first
    launch, and that launch waits for the work already on the device: a process's first
    copy would wait for the model. A handler calls this when it is made."""
    _C.load_kernels(device)


def _device_path(stream: Stream, batch_entry_point: bool, per_copy: bool = False) -> tuple[str, str]:
    """The (path, reason) a device batch on ``stream`` takes, without calling CUDA (for tests)."""
    return _C.device_path(stream, batch_entry_point, per_copy)


def batch_entry_point_version() -> int:
    """Which cuMemcpyBatchAsync the driver offers: 13000, 12080, or 0 for none."""
    return _C.batch_entry_point_version()


_HOST_THREADING_BYTES: int = _C.HOST_THREADING_BYTES  # tests reach it
MAX_HOST_THREADS: int = _C.MAX_HOST_THREADS
