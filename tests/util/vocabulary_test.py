"""kvoffload.util.vocabulary: one Direction and one MemoryKind, their spellings, and that the
entry points taking them normalise what callers pass."""

import itertools

import numpy as np
import pytest

import kvoffload as kv
from kvoffload import _C
from kvoffload.costs import auto
from kvoffload.util.vocabulary import Direction, MemoryKind

LOAD_SPELLINGS = (Direction.LOAD, "load")
STORE_SPELLINGS = (Direction.STORE, "store")


def test_every_spelling_of_a_direction_is_that_direction():
    for spellings, member in ((LOAD_SPELLINGS, Direction.LOAD), (STORE_SPELLINGS, Direction.STORE)):
        for spelling in spellings:
            assert Direction.parse(spelling, "direction") is member
    assert Direction.LOAD.native == _C.Direction.LOAD and Direction.STORE.native == _C.Direction.STORE
    assert sorted(_C.Direction.__members__) == sorted(Direction.__members__)
    # The C++ values, which a positional bool also converts to: False stores, True loads.
    assert (int(_C.Direction.STORE.value), int(_C.Direction.LOAD.value)) == (0, 1)


@pytest.mark.parametrize("value,error,message", [
    ("up", ValueError, r"where: expected one of \('load', 'store'\), got 'up'"),
    ("h2d", ValueError, r"where: expected one of \('load', 'store'\), got 'h2d'"),
    ("LOAD", ValueError, r"where: expected one of"),
    (True, TypeError, r"where: expected a Direction or one of .*, got bool"),
    (None, TypeError, r"where: expected a Direction or one of .*, got NoneType"),
    (MemoryKind.HOST, ValueError, r"where: expected one of"),
])
def test_anything_else_is_refused_naming_the_argument(value, error, message):
    with pytest.raises(error, match=message):
        Direction.parse(value, "where")


def test_ends_and_host_side_agree_with_the_kinds():
    rng = np.random.default_rng(3)
    for direction in Direction:
        host, device = rng.integers(1, 1 << 40, 2).tolist()
        src, dst = direction.ends(host, device)
        assert direction.host_of(src, dst) == host
        assert direction.ends(MemoryKind.HOST, MemoryKind.DEVICE) == direction.kinds
        assert (src == host) == (direction is Direction.LOAD) and (dst == host) == (direction is Direction.STORE)


def test_words_print_as_their_value():
    for word in itertools.chain(Direction, MemoryKind):
        assert str(word) == f"{word}" == word.value and word == word.value


def test_memory_kinds_are_the_cores():
    names = set(_C.MemoryKind.__members__)
    assert names == {k.name for k in MemoryKind} | {"UNKNOWN"}
    assert [k.native for k in MemoryKind] == [_C.MemoryKind.HOST, _C.MemoryKind.DEVICE]
    assert MemoryKind.parse("host", "kind") is MemoryKind.HOST
    with pytest.raises(ValueError, match=r"kind: expected one of \('host', 'device'\), got 'managed'"):
        MemoryKind.parse("managed", "kind")


def host_memory(rng):
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    return src, np.full(4096, 0xA5, np.uint8)


def host_only_registry(src, dst):
    r = kv.MemoryRegistry()
    r.register("src", src.ctypes.data, src.nbytes, MemoryKind.HOST)
    r.register("dst", dst.ctypes.data, dst.nbytes, "host")
    return r


def staged(direction):
    """The staged copy, every way its direction may be given."""
    return [lambda *a, **k: kv.staged_copy(*a, direction, **k),
            lambda *a, **k: kv.staged_copy(*a, direction=direction, **k),
            lambda *a, **k: auto.copy(*a, direction=direction, method="staged", **k)]


@pytest.mark.parametrize("direction,load", [(d, True) for d in LOAD_SPELLINGS]
                         + [(d, False) for d in STORE_SPELLINGS])
def test_the_staged_copy_checks_the_device_side_its_direction_names(direction, load):
    # Both sides are registered host memory: the side checked as device memory is refused.
    rng = np.random.default_rng(4)
    src, dst = host_memory(rng)
    offsets = rng.integers(0, 4000, 5)
    args = (offsets + src.ctypes.data, offsets + dst.ctypes.data, np.full(5, 64))
    side = "dst" if load else "src"
    for copy in staged(direction):
        with pytest.raises(ValueError, match=rf"^{side}\[0\]: .* outside registered device memory"):
            copy(*args, registry=host_only_registry(src, dst))
    assert (dst == 0xA5).all()


def test_the_staged_copy_refuses_a_bad_or_doubled_direction():
    src, dst = host_memory(np.random.default_rng(5))
    args = ([src.ctypes.data], [dst.ctypes.data], [64])
    with pytest.raises(ValueError, match=r"direction: expected one of"):
        kv.staged_copy(*args, "sideways", registry=kv.UNCHECKED)
    with pytest.raises(TypeError, match=r"direction: missing"):
        kv.staged_copy(*args, registry=kv.UNCHECKED)
    for old in (True, "h2d"):  # the spellings before one vocabulary
        with pytest.raises((TypeError, ValueError), match=r"direction: expected"):
            kv.staged_copy(*args, old, registry=kv.UNCHECKED)
    with pytest.raises(TypeError, match=r"host_is_src"):
        kv.staged_copy(*args, host_is_src=True, registry=kv.UNCHECKED)
    with pytest.raises(ValueError, match=r"direction: expected one of"):
        auto.copy(*args, direction="sideways", method="batch", registry=kv.UNCHECKED)
    assert (dst == 0xA5).all()
