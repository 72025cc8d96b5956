"""kvoffload: moves LLM KV-cache blocks between GPU memory and host memory."""

# The one definition of the version; the wheel's name and METADATA read it from here.
__version__ = "0.1.0"

from .copy.batch_copy import (
    CopyResult,
    CudaError,
    NoCudaDeviceError,
    SrcAccessOrder,
    batch_copy,
    batch_entry_point_version,
    copy_blocks,
    host_copy,
    kernel_copy,
    load_kernels,
    staged_copy,
    stream_device,
)
from .copy.methods import Batch, Kernel, PerCopy, Staged
from .copy.ordering import UnsafeCopyError
from .copy.registry import UNCHECKED, MemoryRegistry
from .costs.auto import Auto
from .costs.cache import CalibrationCacheError
from .jobs.handler import OffloadHandler, TransferResult
from .pages.paths import PagePath, Pages
from .pages.planner import CPUSpec, GPUSpec
from .pool.host_pool import PoolNotReadyError, PoolOptions
from .pool.memory import PinnedMemoryError
from .util.vocabulary import Direction, MemoryKind

__all__ = [
    # The handler: what a user constructs, passes and catches.
    "OffloadHandler",
    "GPUSpec",
    "CPUSpec",
    "PoolOptions",
    "Pages",
    "PagePath",
    "Auto",
    "Batch",
    "Kernel",
    "PerCopy",
    "Staged",
    "TransferResult",
    "PinnedMemoryError",
    "PoolNotReadyError",
    "CalibrationCacheError",
    # The raw-pointer copies.
    "UNCHECKED",
    "MemoryRegistry",
    "CopyResult",
    "CudaError",
    "Direction",
    "MemoryKind",
    "NoCudaDeviceError",
    "SrcAccessOrder",
    "UnsafeCopyError",
    "batch_copy",
    "batch_entry_point_version",
    "copy_blocks",
    "host_copy",
    "kernel_copy",
    "load_kernels",
    "staged_copy",
    "stream_device",
]
