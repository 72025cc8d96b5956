"""The words and argument checks every layer of kvoffload shares; imports nothing above it."""

from .arguments import check_max_slowdown, is_int, require_int
from .vocabulary import Direction, MemoryKind

__all__ = [
    "Direction", "MemoryKind", "check_max_slowdown", "is_int", "require_int"
]
