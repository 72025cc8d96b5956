"""kvoffload.copy.methods without a GPU: each method object hands its own options, the
direction and the order to the copy call it stands for; names resolve to the defaults."""

import numpy as np
import pytest

import kvoffload as kv
from kvoffload.copy import methods as copy_methods
from kvoffload.copy.batch_copy import KERNEL_CTAS, STAGED_SLOTS
from kvoffload.copy.methods import Batch, Kernel, PerCopy, Staged, copy_method
from kvoffload.costs import auto


@pytest.fixture
def calls(monkeypatch):
    """Replaces the copy calls with recorders: (function name, args, kwargs) per call that
    copies something (a method made checks its options with an empty one)."""
    seen = []

    def recorder(name):
        def record(*args, **kwargs):
            if len(args[2]):
                seen.append((name, args, kwargs))
            return name
        return record

    for name in ("batch_copy", "kernel_copy", "staged_copy"):
        monkeypatch.setattr(copy_methods, name, recorder(name))
    return seen


def random_rows(rng):
    n = int(rng.integers(1, 50))
    return rng.integers(1, 1 << 40, n), rng.integers(1, 1 << 40, n), rng.integers(1, 4096, n)


@pytest.mark.parametrize("seed", range(5))
def test_each_method_passes_its_own_options(calls, seed):
    rng = np.random.default_rng(seed)
    src, dst, sizes = random_rows(rng)
    ctas, slots, slot = int(rng.integers(1, 64)), int(rng.integers(2, 9)), int(rng.integers(1, 64)) << 20
    order, stream = kv.SrcAccessOrder.ANY, int(rng.integers(3, 1000))
    registry = kv.MemoryRegistry()
    for method in (PerCopy(), Batch(), Kernel(max_ctas=ctas), Staged(slot_bytes=slot, slots=slots, max_ctas=ctas)):
        method(src, dst, sizes, stream, direction="store", order=order, registry=registry)
    (f0, a0, k0), (f1, a1, k1), (f2, a2, k2), (f3, a3, k3) = calls
    assert (f0, k0) == ("batch_copy", dict(order=order, per_copy=True, registry=registry))
    assert (f1, k1) == ("batch_copy", dict(order=order, registry=registry))
    assert f2 == "kernel_copy" and a2[3:] == (stream, ctas) and k2 == dict(registry=registry)
    assert f3 == "staged_copy" and a3[3:] == (kv.Direction.STORE, stream, slot, slots, ctas)
    for args in (a0, a1, a2, a3):
        assert args[0] is src and args[1] is dst and args[2] is sizes


def test_names_resolve_to_the_defaults_and_auto_runs_a_given_object(calls):
    assert copy_method("kernel") == Kernel() and copy_method("staged") == Staged()
    assert Kernel().max_ctas == KERNEL_CTAS and Staged().slots == STAGED_SLOTS
    assert set(copy_methods.METHODS) < set(copy_methods.CANDIDATES)
    assert copy_method("kernel_ctas2") == Kernel(max_ctas=2)
    method = Kernel(max_ctas=3)
    assert copy_method(method) is method
    assert auto.copy([1], [2], [3], 7, direction="load", method=method, registry=kv.UNCHECKED) == "kernel_copy"
    assert calls[0][1][3:] == (7, 3)


@pytest.mark.parametrize("bad", ["fastest", 3, None, Kernel])
def test_an_unknown_method_is_refused_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"method: expected one of \('per_copy', 'batch', 'kernel', 'staged', 'kernel_ctas2', 'kernel_ctas4'\)"):
        copy_method(bad)


@pytest.mark.parametrize("make,message", [
    (lambda: Kernel(max_ctas=0), r"max_ctas: must be >= 1, got 0"),
    (lambda: Staged(slots=1), r"slots: must be >= 2, got 1"),
    (lambda: Staged(slot_bytes=1000), r"slot_bytes: must be a multiple of 256 and >= 4096, got 1000"),
    (lambda: Staged(max_ctas=-2), r"max_ctas: must be >= 1, got -2"),
    (lambda: Kernel(max_ctas=1 << 40), r"max_ctas: 1099511627776 does not fit in 32 bits"),
    (lambda: Staged(slots=-(1 << 31) - 1), r"slots: -2147483649 does not fit in 32 bits"),
    (lambda: Staged(slot_bytes=1 << 63), r"slot_bytes: 9223372036854775808 does not fit in 64 bits"),
])
def test_bad_options_are_refused_when_the_method_is_made(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("make", [lambda: Kernel(max_ctas="8"), lambda: Kernel(max_ctas=True),
                                  lambda: Staged(slots=2.0), lambda: Staged(slot_bytes=None)])
def test_options_that_are_not_ints_are_a_type_error_naming_them(make):
    with pytest.raises(TypeError, match=r"^(max_ctas|slots|slot_bytes): expected an int, got"):
        make()
