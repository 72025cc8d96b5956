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
from kvoffload.registry import UNCHECKED, MemoryRegistry
from kvoffload.vocabulary import Direction, MemoryKind

__all__ = [
    "UNCHECKED",
    "MemoryRegistry",
    "CopyResult",
    "CudaError",
    "Direction",
    "MemoryKind",
    "NoCudaDeviceError",
    "SrcAccessOrder",
    "batch_copy",
    "batch_entry_point_version",
    "copy_blocks",
    "host_copy",
    "kernel_copy",
    "load_kernels",
    "staged_copy",
    "stream_device",
]
