"""kvoffload.copy.ordering: the source access order for every combination of inputs."""

import itertools

import pytest

from kvoffload import SrcAccessOrder
from kvoffload.copy.ordering import (MemoryKind, PendingWrites, UnsafeCopyError, decide,
                                format_policy_table, policy_table, safe_order)

K, P = MemoryKind, PendingWrites
STREAM, ANY, DURING = SrcAccessOrder.STREAM, SrcAccessOrder.ANY, SrcAccessOrder.DURING_API_CALL
REFUSED = None

# Source kind -> {(pending writes, ephemeral): order}, for a device destination.
TO_DEVICE = {
    K.DEVICE: {(P.NO, False): ANY, (P.YES, False): STREAM, (P.UNKNOWN, False): STREAM,
               (P.NO, True): STREAM, (P.YES, True): STREAM, (P.UNKNOWN, True): STREAM},
    K.HOST: {(P.NO, False): ANY, (P.YES, False): STREAM, (P.UNKNOWN, False): STREAM,
             (P.NO, True): DURING, (P.YES, True): REFUSED, (P.UNKNOWN, True): REFUSED},
}
# Host to host: the copy runs on the CPU inside the call.
HOST_TO_HOST = {P.NO: DURING, P.YES: REFUSED, P.UNKNOWN: REFUSED}


def expected(src, dst, pending, ephemeral):
    if src is K.HOST and dst is K.HOST:
        return HOST_TO_HOST[pending]
    return TO_DEVICE[src][(pending, ephemeral)]


ALL = list(itertools.product(MemoryKind, MemoryKind, PendingWrites, (False, True)))


@pytest.mark.parametrize("src,dst,pending,ephemeral", ALL,
                         ids=[f"{s.name}-{d.name}-{p.name}-{'eph' if e else 'live'}" for s, d, p, e in ALL])
def test_every_combination(src, dst, pending, ephemeral):
    decision = decide(src, dst, pending, ephemeral)
    assert decision.order == expected(src, dst, pending, ephemeral)
    assert len(decision.reason) > 20
    if decision.order is None:
        with pytest.raises(UnsafeCopyError, match="synchronize its writers first"):
            safe_order(src, dst, pending, ephemeral)
    else:
        assert safe_order(src, dst, pending, ephemeral) == decision.order


def test_any_only_when_the_source_is_quiescent():
    for src, dst, pending, ephemeral, decision in policy_table():
        if decision.order in (ANY, DURING):
            assert pending is P.NO


def test_a_load_after_a_store_in_flight_reads_in_stream_order():
    decision = decide(K.HOST, K.DEVICE, P.YES)
    assert decision.order == STREAM and "waiting on an event does not make ANY safe" in decision.reason


def test_a_load_from_a_quiescent_pinned_pool_may_read_at_any_time():
    assert decide(K.HOST, K.DEVICE, P.NO).order == ANY


def test_a_store_from_the_device_is_stream_ordered_unless_asserted_quiescent():
    assert decide(K.DEVICE, K.HOST, P.UNKNOWN).order == STREAM
    asserted = decide(K.DEVICE, K.HOST, P.NO)
    assert asserted.order == ANY and "asserts" in asserted.reason


def test_the_printed_table_has_a_row_per_combination():
    table = format_policy_table()
    print(table)
    rows = table.splitlines()[2:]
    assert len(rows) == len(ALL) == 2 * 2 * 3 * 2
    assert sum("refused" in r for r in rows) == sum(expected(*c) is None for c in ALL)


def test_kinds_may_be_spelled_as_strings_and_nothing_else():
    for pending, ephemeral in itertools.product(PendingWrites, (False, True)):
        assert decide("host", "device", pending, ephemeral) == decide(K.HOST, K.DEVICE, pending, ephemeral)
        assert decide("device", "host", pending, ephemeral) == decide(K.DEVICE, K.HOST, pending, ephemeral)
    with pytest.raises(ValueError, match=r"src: expected one of \('host', 'device'\), got 'pinned host'"):
        decide("pinned host", K.DEVICE, P.NO)
    with pytest.raises(TypeError, match=r"dst: expected a MemoryKind"):
        safe_order(K.HOST, 1, P.NO)
