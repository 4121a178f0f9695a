"""What the benchmarks share: a streaming client that times each event of a request (the
`slotwise serve` subprocess they run is `proxy/testbed/slotwise.py`'s)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson


@dataclass
class StreamResult:
    sent: float
    headers: float | None = None
    tokens: list[float] = field(default_factory=list)
    ended: float | None = None
    status: int = 0
    text: str = ""
    """The reply's text (`detail` only): a chat app sends it back in the next turn."""
    timings: dict[str, Any] | None = None
    """The server's `timings` from the stream's last chunk (`detail` only)."""

    @property
    def ttft(self) -> float | None:
        return self.tokens[0] - self.sent if self.tokens else None


async def timed_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], *,
                       headers: Mapping[str, str] | None = None, detail: bool = False,
                       into: StreamResult | None = None) -> StreamResult:
    """POST a streaming chat request; note when each token event arrives. With `detail`, each
    event is decoded too, for the reply's text and the server's timings (costs the client CPU).
    `into`: the result to fill, so a caller that cancels the call keeps what it saw."""
    result = into if into is not None else StreamResult(sent=time.monotonic())
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        result.headers = time.monotonic()
        result.status = response.status
        buffer = b""
        async for chunk in response.content.iter_any():
            now = time.monotonic()
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {") and b'"content":"' in event:
                    result.tokens.append(now)
                if detail and event.startswith(b"data: {"):
                    _read_event(result, event[6:])
    result.ended = time.monotonic()
    return result


def _read_event(result: StreamResult, data: bytes) -> None:
    """The text and timings one chat stream event carries (`detail`)."""
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        return
    if isinstance(timings := event.get("timings"), dict):
        result.timings = timings
    for choice in event.get("choices") or ():
        content = (choice.get("delta") or {}).get("content")
        if isinstance(content, str):
            result.text += content


def temp_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
