"""The SSE parser: events come out whole and unchanged, however the bytes are split."""

from __future__ import annotations

import pytest

from proxy.request.sse import SseEvent, SseParser

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
