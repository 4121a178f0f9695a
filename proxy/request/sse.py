"""An incremental parser for server-sent events: bytes in, complete events out.

It never buffers more than one incomplete event (at most `max_event_bytes` of it), keeps each
event's exact bytes (so a relay can pass them on unchanged, or drop one), and knows nothing about
what the events mean. Each byte is searched about once: a search resumes where the last one stopped,
so a large event that arrives in many pieces costs time in proportion to its size, not its square.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import NoReturn

# An event ends at the first blank line: two line ends in a row, each LF, CRLF or CR.
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LONGEST_END = 4  # b"\r\n\r\n": an end may straddle two pieces by up to 3 bytes


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes
    """The event's bytes as received, its terminating blank line included."""
    data: bytes | None
    """The joined `data:` lines, or None for an event with no data (a comment such as a ping)."""
    name: bytes | None = None
    """The `event:` field, if any."""


class EventTooLarge(ValueError):
    """An event grew past the parser's limit. `events` are the complete ones before it."""

    def __init__(self, limit: int, events: list[SseEvent]) -> None:
        super().__init__(f"an event grew past {limit} bytes")
        self.limit = limit
        self.events = events


class SseParser:
    """Feed it the stream's bytes in any pieces; it returns each event once it is complete."""

    def __init__(self, max_event_bytes: int | None = None) -> None:
        self._buffer = bytearray()
        self._resume = 0  # no event end starts before this offset of the buffer
        self._max = max_event_bytes if max_event_bytes is not None else sys.maxsize

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet complete (what is left if the stream ends here)."""
        return bytes(self._buffer)

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events `chunk` completes; EventTooLarge once one grows past the limit."""
        pending = self._buffer
        if pending:
            pending += chunk
        buffer = pending if pending else chunk  # usually nothing is pending: no copy then
        events: list[SseEvent] = []
        start, pos = 0, self._resume
        # A lone CR at the very end may be the first half of a CRLF: wait for the next byte.
        limit = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
        while (match := _EVENT_END.search(buffer, pos, limit)) is not None:
            end = match.end()
            if end - start > self._max:
                self._fail(events)
            if buffer is chunk:
                events.append(_parse_event(chunk[start:end], chunk[start:match.start()]))
            else:
                events.append(_parse_event(bytes(pending[start:end]),
                                           bytes(pending[start:match.start()])))
            start = pos = end
        if buffer is pending:
            del pending[:start]
        else:
            pending += chunk[start:]
        if len(pending) > self._max:
            self._fail(events)
        self._resume = max(0, limit - start - (_LONGEST_END - 1))
        return events

    def _fail(self, events: list[SseEvent]) -> NoReturn:
        self._buffer.clear()
        self._resume = 0
        raise EventTooLarge(self._max, events)


def _parse_event(raw: bytes, body: bytes) -> SseEvent:
    data_lines: list[bytes] = []
    name: bytes | None = None
    for line in body.splitlines():
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data_lines.append(value)
        elif field == b"event":
            name = value
    data = b"\n".join(data_lines) if data_lines else None
    return SseEvent(raw=raw, data=data, name=name)
