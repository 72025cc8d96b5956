"""kvoffload's meter: what copies kept in flight cost a model running beside them (meter),
the model's loop (compute_loop) and the copy sources it keeps in flight (sources)."""

from .compute_loop import WORKLOADS, ComputeLoop
from .meter import CALIBRATION_WORKLOAD, NOISE, ROUNDS, STEPS, Result, alone, measure
from .sources import DIRECTIONS, BulkCopies, RawCopies, WorkerCopies

__all__ = [
    "CALIBRATION_WORKLOAD", "DIRECTIONS", "NOISE", "ROUNDS", "STEPS", "WORKLOADS", "BulkCopies", "ComputeLoop",
    "RawCopies", "Result", "WorkerCopies", "alone", "measure",
]
