"""The SSE parser: events come out whole and unchanged, however the bytes are split."""

from __future__ import annotations

import random
import re
import time

import pytest

from proxy.request import sse
from proxy.request.sse import EventTooLarge, SseEvent, SseParser

STREAM = (
    b'data: {"content":"a"}\n\n'
    b": ping\n\n"
    b'event: delta\r\ndata: {"x":1}\r\ndata: {"y":2}\r\n\r\n'
    b'data: {"content":"\xc3\xa9"}\r\r'
    b"data: [DONE]\n\n"
)


def parse_in_pieces(data: bytes, cuts: list[int]) -> tuple[list[SseEvent], bytes]:
    parser = SseParser()
    events: list[SseEvent] = []
    last = 0
    for cut in [*cuts, len(data)]:
        events += parser.feed(data[last:cut])
        last = cut
    return events, parser.pending


def test_events_are_parsed_with_their_exact_bytes() -> None:
    events, pending = parse_in_pieces(STREAM, [])
    assert pending == b""
    assert b"".join(e.raw for e in events) == STREAM
    assert [e.data for e in events] == [
        b'{"content":"a"}', None, b'{"x":1}\n{"y":2}', b'{"content":"\xc3\xa9"}', b"[DONE]"]
    assert events[2].name == b"delta"


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_a_split_at_every_offset_gives_the_same_events(cut: int) -> None:
    whole, _ = parse_in_pieces(STREAM, [])
    split, pending = parse_in_pieces(STREAM, [cut])
    assert split == whole and pending == b""


def test_byte_by_byte_gives_the_same_events() -> None:
    whole, _ = parse_in_pieces(STREAM, [])
    one_by_one, _ = parse_in_pieces(STREAM, list(range(1, len(STREAM))))
    assert one_by_one == whole


def test_an_unfinished_event_stays_pending() -> None:
    events, pending = parse_in_pieces(b'data: {"a":1}\n\ndata: {"b"', [])
    assert [e.data for e in events] == [b'{"a":1}']
    assert pending == b'data: {"b"'


def test_random_splits_of_a_stream_full_of_line_ends_give_the_same_events() -> None:
    rng = random.Random(7)
    data = bytes(rng.choice(b"\r\n\r\nab:") for _ in range(4000))
    whole, whole_pending = parse_in_pieces(data, [])
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), 300))
        assert parse_in_pieces(data, cuts) == (whole, whole_pending)


def test_an_event_over_the_limit_raises_with_the_events_before_it() -> None:
    parser = SseParser(max_event_bytes=100)
    assert parser.feed(b"data: " + b"x" * 80) == []
    with pytest.raises(EventTooLarge) as info:
        parser.feed(b"x" * 30)
    assert info.value.limit == 100 and info.value.events == []
    assert parser.pending == b""  # nothing of it is kept
    with pytest.raises(EventTooLarge) as info:
        parser.feed(b"data: a\n\n" + b"data: " + b"y" * 200)
    assert [e.data for e in info.value.events] == [b"a"]


def test_an_event_at_the_limit_passes() -> None:
    event = b"data: " + b"x" * 92 + b"\n\n"
    assert [e.raw for e in SseParser(max_event_bytes=100).feed(event)] == [event]


class CountingPattern:
    """The parser's end-of-event pattern, counting the bytes each search is given to look at."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self.scanned = 0

    def search(self, buffer: bytes, pos: int, endpos: int) -> re.Match[bytes] | None:
        self.scanned += max(endpos - pos, 0)
        return self.pattern.search(buffer, pos, endpos)


def test_a_large_event_in_small_pieces_is_searched_once_not_again_per_piece(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingPattern(sse._EVENT_END)
    monkeypatch.setattr(sse, "_EVENT_END", counting)
    event = b"data: " + b"x" * (1 << 20) + b"\n\n"  # 1 MiB in 4 KiB pieces
    pieces = [event[i:i + 4096] for i in range(0, len(event), 4096)]
    parser = SseParser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    assert [e.raw for e in events] == [event]
    assert counting.scanned < len(event) + 4 * len(pieces)  # rescanning would be ~len * pieces / 2


def test_a_32_mib_event_in_4_kib_pieces_costs_little_cpu() -> None:
    parser = SseParser(max_event_bytes=64 << 20)
    piece = b"x" * 4096
    started = time.process_time()
    assert parser.feed(b"data: ") == []
    for _ in range((32 << 20) // 4096):
        parser.feed(piece)
    assert len(parser.feed(b"\n\n")) == 1
    assert time.process_time() - started < 2.0  # it was about 5 CPU-s with 64 KiB pieces
