"""Copies of raw addresses: the calls of kvoffload._C, the memory registry that vouches for
every address, the copy methods as objects and the safe source access order. The layer
under pages, pools and jobs; it knows nothing of KV-cache layouts."""

from .batch_copy import (CopyResult, NoCudaDeviceError, SrcAccessOrder, batch_copy, copy_blocks, host_copy,
                         kernel_copy, staged_copy)
from .methods import CANDIDATES, METHODS, Batch, Kernel, PerCopy, Staged, copy_method
from .ordering import UnsafeCopyError, safe_order
from .registry import UNCHECKED, MemoryRegistry, require_registry
from .writable import is_writable, require_writable

__all__ = [
    "Batch", "CANDIDATES", "CopyResult", "Kernel", "METHODS", "MemoryRegistry",
    "NoCudaDeviceError", "PerCopy", "SrcAccessOrder", "Staged", "UNCHECKED", "UnsafeCopyError",
    "batch_copy", "copy_blocks", "copy_method", "host_copy", "is_writable", "kernel_copy",
    "require_registry", "require_writable", "safe_order", "staged_copy"
]
