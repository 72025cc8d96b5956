"""Asynchronous transfer jobs: the handler, how it copies its jobs (methods), the lanes they
run on, and which jobs of other lanes each must wait for (accesses, conflicts)."""

from .handler import OffloadHandler, TransferResult
from .lanes import CudaLanes, HostLanes, Lanes
from .methods import NAMES, job_method, method_object

__all__ = [
    "CudaLanes", "HostLanes", "Lanes", "NAMES", "OffloadHandler", "TransferResult", "job_method",
    "method_object"
]
