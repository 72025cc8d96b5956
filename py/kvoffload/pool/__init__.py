"""The host pool a handler offloads into: its memory (anonymous or a shared file), where each
tensor's chunks go (layout), where its registrations end, and its NUMA placement."""

from .host_pool import HostPool, PoolNotReadyError, PoolOptions
from .layout import CPU_LAYOUTS
from .memory import PinnedMemoryError, PoolMemory
from .shm_file import SharedFile

__all__ = [
    "CPU_LAYOUTS", "HostPool", "PinnedMemoryError", "PoolMemory", "PoolNotReadyError",
    "PoolOptions", "SharedFile"
]
