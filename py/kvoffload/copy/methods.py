"""The raw-pointer copy methods as objects: each holds its own options, and calling one
copies a batch, so the layers above pass one ready method instead of its knobs.

``order`` says how a DMA method may read the source (kvoffload.copy.ordering picks the
safe one); the SM methods read in stream order, which every order allows.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Union

import numpy as np

from .batch_copy import (KERNEL_CTAS, STAGED_CTAS, STAGED_SLOT_BYTES, STAGED_SLOTS, CopyResult,
                                  SrcAccessOrder, batch_copy, kernel_copy, staged_copy)
from ..util.arguments import is_int
from ..util.vocabulary import Direction
from .registry import UNCHECKED

_NOTHING = np.zeros(0, dtype=np.int64)


def _option(default: int, bits: int = 32):
    """A field that must be an int its C++ parameter (of ``bits`` bits) holds."""
    return dataclasses.field(default=default, metadata={"bits": bits})


def _check_options(method) -> None:
    """Each option is an int of its C++ width, then the copy's own checks run (in C++,
    before any CUDA call) on an empty batch."""
    for field in dataclasses.fields(method):
        value, limit = getattr(method, field.name), 1 << (field.metadata["bits"] - 1)
        if not is_int(value):
            raise TypeError(f"{field.name}: expected an int, got {type(value).__name__}")
        if not -limit <= value < limit:
            raise ValueError(f"{field.name}: {value} does not fit in {field.metadata['bits']} bits")
    method(_NOTHING, _NOTHING, _NOTHING, direction=Direction.LOAD, registry=UNCHECKED)


@dataclasses.dataclass(frozen=True)
class PerCopy:
    """One cudaMemcpyAsync per copy."""

    name: ClassVar[str] = "per_copy"

    def __call__(self, src, dst, sizes, stream=None, *, direction: Direction | str,
                 order=SrcAccessOrder.STREAM, registry) -> CopyResult:
        return batch_copy(src, dst, sizes, stream, order=order, per_copy=True, registry=registry)


@dataclasses.dataclass(frozen=True)
class Batch:
    """The driver's batch copy (cuMemcpyBatchAsync)."""

    name: ClassVar[str] = "batch"

    def __call__(self, src, dst, sizes, stream=None, *, direction: Direction | str,
                 order=SrcAccessOrder.STREAM, registry) -> CopyResult:
        return batch_copy(src, dst, sizes, stream, order=order, registry=registry)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """The SM copy kernel on at most ``max_ctas`` CTAs."""

    name: ClassVar[str] = "kernel"
    max_ctas: int = _option(KERNEL_CTAS)

    def __post_init__(self):
        _check_options(self)

    def __call__(self, src, dst, sizes, stream=None, *, direction: Direction | str,
                 order=SrcAccessOrder.STREAM, registry) -> CopyResult:
        return kernel_copy(src, dst, sizes, stream, self.max_ctas, registry=registry)


@dataclasses.dataclass(frozen=True)
class Staged:
    """DMA of host runs through a device ring of ``slots`` x ``slot_bytes``, and a
    gather or scatter kernel of at most ``max_ctas`` CTAs."""

    name: ClassVar[str] = "staged"
    slot_bytes: int = _option(STAGED_SLOT_BYTES, bits=64)
    slots: int = _option(STAGED_SLOTS)
    max_ctas: int = _option(STAGED_CTAS)

    def __post_init__(self):
        _check_options(self)

    def __call__(self, src, dst, sizes, stream=None, *, direction: Direction | str,
                 order=SrcAccessOrder.STREAM, registry) -> CopyResult:
        return staged_copy(src, dst, sizes, Direction.parse(direction, "direction"), stream,
                           self.slot_bytes, self.slots, self.max_ctas, registry=registry)


CopyMethod = Union[PerCopy, Batch, Kernel, Staged]

# Each method with its default options, by name.
METHODS: dict[str, CopyMethod] = {m.name: m for m in (PerCopy(), Batch(), Kernel(), Staged())}
# What auto chooses among (kvoffload.costs.calibration measures each), by name: the copy kernel
# on 2 or 4 CTAs moves less alone than on its default 8 but may cost a model beside it less.
CANDIDATES: dict[str, CopyMethod] = {**METHODS, "kernel_ctas2": Kernel(max_ctas=2),
                                     "kernel_ctas4": Kernel(max_ctas=4)}


def copy_method(method: str | CopyMethod, name: str = "method") -> CopyMethod:
    """The candidate of that name, or the method object itself."""
    if isinstance(method, (PerCopy, Batch, Kernel, Staged)):
        return method
    if isinstance(method, str) and method in CANDIDATES:
        return CANDIDATES[method]
    raise ValueError(f"{name}: expected one of {tuple(CANDIDATES)} or a kvoffload.copy.methods "
                     f"object, got {method!r}")
