"""Which source access order is safe for a copy.

With ANY, the copy engine may read the source before earlier work in the stream has
finished, waits on events included; with DURING_API_CALL it reads the source before
the submitting call returns, also out of stream order. So both are safe only when no
stream has writes to the source pending at submission. Everything else reads in
stream order (STREAM). Kinds are kvoffload.util.vocabulary.MemoryKind: HOST (page-locked or
pageable: no rule tells them apart) and DEVICE (device or managed memory).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools

from ..util.vocabulary import MemoryKind
from .batch_copy import SrcAccessOrder

HOST = MemoryKind.HOST


class PendingWrites(enum.Enum):
    """Whether any stream may still write the source when the copy is submitted."""

    NO = "no"
    YES = "yes"
    UNKNOWN = "unknown"


class UnsafeCopyError(ValueError):
    """No source access order makes this copy safe; the reason says what to do."""


@dataclasses.dataclass(frozen=True)
class Decision:
    order: SrcAccessOrder | None  # None: no order is safe
    reason: str


# The rules, first match wins: (applies(src, dst, pending, ephemeral), order, reason).
_RULES = (
    (lambda s, d, p, e: s is HOST and d is HOST and p is not PendingWrites.NO, None,
     "host-to-host copies run on the CPU inside the call, so queued writes to the source "
     "would be missed; synchronize its writers first"),
    (lambda s, d, p, e: s is HOST and d is HOST, SrcAccessOrder.DURING_API_CALL,
     "host-to-host copies run on the CPU inside the call"),
    (lambda s, d, p, e: e and s is HOST and p is not PendingWrites.NO, None,
     "the source dies when the call returns but may still be written by queued work; "
     "synchronize its writers first"),
    (lambda s, d, p, e: e and s is HOST, SrcAccessOrder.DURING_API_CALL,
     "the host source dies when the call returns, so it must be read before then"),
    (lambda s, d, p, e: e, SrcAccessOrder.STREAM,
     "CUDA frees device and managed memory in stream order, so a stream-ordered read "
     "still sees the source"),
    (lambda s, d, p, e: p is PendingWrites.YES, SrcAccessOrder.STREAM,
     "writes to the source are in flight: only a stream-ordered read, after waiting for "
     "them, sees their result (waiting on an event does not make ANY safe)"),
    (lambda s, d, p, e: p is PendingWrites.UNKNOWN, SrcAccessOrder.STREAM,
     "nobody vouches that the source is quiescent, so it is read in stream order"),
    (lambda s, d, p, e: s is MemoryKind.DEVICE, SrcAccessOrder.ANY,
     "the caller asserts no stream writes the device source (e.g. after a host-side "
     "synchronize), so the copy engine may read it at any time"),
    (lambda s, d, p, e: True, SrcAccessOrder.ANY,
     "no stream writes the source, so the copy engine may read it at any time"),
)


def decide(src: MemoryKind, dst: MemoryKind, pending_writes: PendingWrites,
           ephemeral: bool = False) -> Decision:
    """The source access order for one copy and why; ``order`` is None when none is safe.

    ``ephemeral``: the source's lifetime ends when the submitting call returns.
    """
    src, dst = MemoryKind.parse(src, "src"), MemoryKind.parse(dst, "dst")
    for applies, order, reason in _RULES:
        if applies(src, dst, pending_writes, ephemeral):
            return Decision(order, reason)
    raise AssertionError("the last rule always applies")


def safe_order(src: MemoryKind, dst: MemoryKind, pending_writes: PendingWrites,
               ephemeral: bool = False) -> SrcAccessOrder:
    """Like decide(), but raises UnsafeCopyError when no order is safe."""
    src, dst = MemoryKind.parse(src, "src"), MemoryKind.parse(dst, "dst")
    decision = decide(src, dst, pending_writes, ephemeral)
    if decision.order is None:
        raise UnsafeCopyError(
            f"{src.value} -> {dst.value} copy with pending writes {pending_writes.value}"
            f"{', ephemeral source' if ephemeral else ''}: {decision.reason}")
    return decision.order


def policy_table() -> list[tuple[MemoryKind, MemoryKind, PendingWrites, bool, Decision]]:
    """decide() for every combination of its inputs."""
    return [(s, d, p, e, decide(s, d, p, e))
            for s, d, p, e in itertools.product(MemoryKind, MemoryKind, PendingWrites, (False, True))]


def format_policy_table() -> str:
    """The policy as a Markdown table."""
    lines = ["| source | destination | pending writes | ephemeral | order | reason |",
             "|---|---|---|---|---|---|"]
    for s, d, p, e, decision in policy_table():
        order = decision.order.name if decision.order is not None else "refused"
        lines.append(f"| {s.value} | {d.value} | {p.value} | {'yes' if e else 'no'} | {order} "
                     f"| {decision.reason} |")
    return "\n".join(lines)
