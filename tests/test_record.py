"""The record's overlaps: whose prefill overlapped whose life, and this request's decode inside it."""

from __future__ import annotations

import gc
import weakref

from proxy.record.flight import Flight, Phase
from proxy.record.inflight import Registry
from proxy.record.schema import MAX_OVERLAPS, Overlap, build_record, overlaps
from tests.helpers import make_flight


def flight(name: str, now: float) -> Flight:
    return make_flight(name, now)


def test_a_prefill_that_starts_later_is_seen_with_the_decode_inside_it() -> None:
    registry = Registry()
    stream, cold = flight("stream", 0.0), flight("cold", 1.0)
    registry.add(stream, 0.0)
    for t in (0.5, 1.5, 2.5, 3.5, 4.5):
        stream.timer.on_token(t)
    registry.add(cold, 1.0)
    registry.move(cold, Phase.PREFILLING, 2.0)
    cold.computed_tokens = 3000
    registry.move(cold, Phase.DECODING, 4.0)
    stream.timer.on_end(5.0)
    (seen,) = overlaps(stream)
    assert seen == Overlap(id="cold", computed_tokens=3000, from_ms=2000.0, to_ms=4000.0,
                           decode_events=2, decode_ms=2000.0)
    assert overlaps(cold) == ()  # nobody prefilled during the cold one's life


def test_pieces_fed_ahead_start_the_prefill_and_count_in_its_tokens() -> None:
    registry = Registry()
    stream, cold = flight("stream", 0.0), flight("cold", 0.0)
    registry.add(stream, 0.0)
    registry.add(cold, 0.0)
    registry.move(cold, Phase.HELD, 0.0)
    registry.start_prefill(cold, 1.0)  # the first piece
    cold.prefill.fed_tokens = 2900
    registry.move(cold, Phase.QUEUED, 5.0)
    registry.move(cold, Phase.PREFILLING, 5.1)  # the real request: its start stays the first piece's
    cold.computed_tokens = 100
    registry.move(cold, Phase.DECODING, 5.5)
    stream.timer.on_token(0.5)
    stream.timer.on_token(6.0)
    stream.timer.on_end(6.0)
    (seen,) = overlaps(stream)
    assert (seen.computed_tokens, seen.from_ms, seen.to_ms) == (3000, 1000.0, 5500.0)
    assert len(stream.prefill_peers) == 1  # seen once, not once per start


def test_a_prefill_cut_short_ends_when_its_request_ends() -> None:
    registry = Registry()
    stream, cold = flight("stream", 0.0), flight("cold", 0.0)
    registry.add(stream, 0.0)
    registry.add(cold, 0.0)
    registry.move(cold, Phase.HELD, 0.0)
    registry.start_prefill(cold, 1.0)
    registry.finish(cold, 2.0)  # its client left during the pieces
    stream.timer.on_end(10.0)
    (seen,) = overlaps(stream)
    assert (seen.from_ms, seen.to_ms) == (1000.0, 2000.0)


def test_a_request_arriving_between_pieces_sees_the_prefill_fed_ahead() -> None:
    registry = Registry()
    stream, cold, short = flight("stream", 0.0), flight("cold", 0.0), flight("short", 2.0)
    registry.add(stream, 0.0)
    registry.add(cold, 0.0)
    registry.move(cold, Phase.HELD, 0.0)
    registry.start_prefill(cold, 1.0)  # the first piece; the cold request stays held
    cold.prefill.fed_tokens = 1000
    registry.add(short, 2.0)  # a short turn arrives while the pieces go on
    short.timer.on_token(2.3)
    registry.finish(short, 2.4)
    short.timer.on_end(2.4)
    (seen,) = overlaps(short)
    assert (seen.id, seen.from_ms, seen.to_ms) == ("cold", 0.0, 400.0)


def test_a_long_request_keeps_the_figures_of_finished_peers_not_the_requests() -> None:
    registry = Registry()
    stream = flight("stream", 0.0)
    registry.add(stream, 0.0)
    alive: weakref.WeakSet[Flight] = weakref.WeakSet()
    for i in range(100):
        short = flight(f"short-{i}", float(i))
        alive.add(short)
        registry.add(short, float(i))
        registry.move(short, Phase.PREFILLING, i + 0.1)
        short.computed_tokens = 10
        registry.move(short, Phase.DECODING, i + 0.5)
        registry.finish(short, i + 0.6)
    del short
    gc.collect()
    assert len(alive) == 0  # the long one's record needs their figures, not the requests
    stream.timer.on_end(100.0)
    seen = overlaps(stream)
    assert len(seen) == 100
    assert seen[5] == Overlap(id="short-5", computed_tokens=10, from_ms=5100.0, to_ms=5500.0,
                              decode_events=0, decode_ms=0.0)


def test_a_long_request_lists_its_biggest_overlaps_and_counts_them_all() -> None:
    """3,000 overlaps made one record a 363 KiB line: the record lists the `MAX_OVERLAPS` biggest
    prefills (the ones the report's "decode while a long prefill ran" needs), in time order, and
    `overlaps_total` counts every one."""
    registry = Registry()
    stream = flight("stream", 0.0)
    registry.add(stream, 0.0)
    for i in range(3000):
        t = 0.01 * i
        peer = flight(f"peer-{i}", t)
        registry.add(peer, t)
        registry.move(peer, Phase.PREFILLING, t)
        peer.computed_tokens = (i * 7919) % 3000  # every count from 0 to 2,999 once, in no order
        registry.move(peer, Phase.DECODING, t + 0.005)
        registry.finish(peer, t + 0.006)
    stream.timer.on_end(40.0)
    record = build_record(stream)
    assert record.overlaps_total == 3000 and len(overlaps(stream)) == 3000
    assert len(record.overlaps) == MAX_OVERLAPS
    assert sorted(o.computed_tokens or 0 for o in record.overlaps) == list(
        range(3000 - MAX_OVERLAPS, 3000))
    assert [o.from_ms for o in record.overlaps] == sorted(o.from_ms for o in record.overlaps)
    assert len(record.to_json()) < 8 * 1024


def test_a_request_with_few_overlaps_lists_them_all() -> None:
    registry = Registry()
    stream, cold = flight("stream", 0.0), flight("cold", 1.0)
    registry.add(stream, 0.0)
    registry.add(cold, 1.0)
    registry.move(cold, Phase.PREFILLING, 1.0)
    registry.finish(cold, 2.0)
    stream.timer.on_end(3.0)
    record = build_record(stream)
    assert record.overlaps == overlaps(stream) and record.overlaps_total == 1
