"""The words every layer uses: which way a copy goes (Direction) and what memory it
touches (MemoryKind). Entry points normalise what callers pass with ``parse``; inside
the package only these members travel.
"""

from __future__ import annotations

import enum

from .. import _C


class _Word(str, enum.Enum):
    """A str enum that prints as its value on every Python version (f-strings, keys)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _spellings(cls) -> dict:
        return {member.value: member for member in cls}

    @classmethod
    def parse(cls, value, name: str):
        """``value`` as a member: a member, or one of its spellings. Anything else is a
        ValueError (TypeError for a non-string) naming the argument."""
        if isinstance(value, cls):
            return value
        spellings = cls._spellings()
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a {cls.__name__} or one of {tuple(spellings)}, "
                            f"got {type(value).__name__}")
        if value not in spellings:
            raise ValueError(f"{name}: expected one of {tuple(spellings)}, got {value!r}")
        return spellings[value]


class MemoryKind(_Word):
    """What memory a range is: registered regions, both ends of a copy, the order policy.
    The members are those of the C++ core's MemoryKind (``_C.MemoryKind``, which also has
    UNKNOWN for memory the driver does not know: pageable host memory)."""

    HOST = "host"  # host memory; page-locked where a GPU copies it
    DEVICE = "device"  # device or managed memory

    @property
    def native(self):
        """The C++ core's member of the same name."""
        return _C.MemoryKind.__members__[self.name]


class Direction(_Word):
    """Which way a copy moves bytes between host and device memory, spelt "load" or
    "store" everywhere. The members are those of the C++ core's Direction
    (``_C.Direction``)."""

    LOAD = "load"  # host -> device
    STORE = "store"  # device -> host

    @property
    def native(self):
        """The C++ core's member of the same name (``_C.Direction``)."""
        return _C.Direction.__members__[self.name]

    def ends(self, host, device) -> tuple:
        """(source, destination) of the two sides of a copy this way."""
        return (host, device) if self is Direction.LOAD else (device, host)

    def host_of(self, src, dst):
        """The host side of (src, dst)."""
        return src if self is Direction.LOAD else dst

    @property
    def kinds(self) -> tuple[MemoryKind, MemoryKind]:
        """(source kind, destination kind)."""
        return self.ends(MemoryKind.HOST, MemoryKind.DEVICE)
