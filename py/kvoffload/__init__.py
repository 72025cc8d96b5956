"""kvoffload: moves LLM KV-cache blocks between GPU memory and host memory."""

# The one definition of the version; the wheel's name and METADATA read it from here.
__version__ = "0.1.0"

from kvoffload.batch_copy import (
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
from kvoffload.auto import Auto
from kvoffload.calibration_cache import CalibrationCacheError
from kvoffload.copy_methods import Batch, Kernel, PerCopy, Staged
from kvoffload.handler import OffloadHandler, TransferResult
from kvoffload.host_pool import PoolNotReadyError, PoolOptions
from kvoffload.ordering import UnsafeCopyError
from kvoffload.page_methods import PagePath, Pages
from kvoffload.planner import CPUSpec, GPUSpec
from kvoffload.pool_memory import PinnedMemoryError
from kvoffload.registry import UNCHECKED, MemoryRegistry
from kvoffload.vocabulary import Direction, MemoryKind

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
