"""An incremental parser for server-sent events: bytes in, complete events out.

It never buffers more than one incomplete event, keeps each event's exact bytes (so a relay can pass
them on unchanged, or drop one), and knows nothing about what the events mean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# An event ends at the first blank line: two line ends in a row, each LF, CRLF or CR.
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")


@dataclass(frozen=True, slots=True)
class SseEvent:
    raw: bytes
    """The event's bytes as received, its terminating blank line included."""
    data: bytes | None
    """The joined `data:` lines, or None for an event with no data (a comment such as a ping)."""
    name: bytes | None = None
    """The `event:` field, if any."""


class SseParser:
    """Feed it the stream's bytes in any pieces; it returns each event once it is complete."""

    def __init__(self) -> None:
        self._pending = b""

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet complete (what is left if the stream ends here)."""
        return self._pending

    def feed(self, chunk: bytes) -> list[SseEvent]:
        buffer = self._pending + chunk if self._pending else chunk
        events: list[SseEvent] = []
        start = 0
        # A lone CR at the very end may be the first half of a CRLF: wait for the next byte.
        limit = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
        while True:
            match = _EVENT_END.search(buffer, start, limit)
            if match is None:
                break
            end = match.end()
            events.append(_parse_event(buffer[start:end], buffer[start:match.start()]))
            start = end
        self._pending = buffer[start:]
        return events


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
