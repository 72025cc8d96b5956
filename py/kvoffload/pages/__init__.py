"""KV-cache pages: the multi-group layouts and transfer specs (planner), the C++ page table
that turns a job's ids into copies (table), and the paths a page job may take (paths)."""

from .paths import PagePath, Pages
from .planner import CPUSpec, GPUSpec, KVLayout, TransferPlan
from .table import page_table

__all__ = [
    "CPUSpec", "GPUSpec", "KVLayout", "PagePath", "Pages", "TransferPlan", "page_table"
]
