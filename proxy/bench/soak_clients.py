"""The soak's clients: each behaviour is one coroutine that makes one request (or holds one silent
socket) and says whether slotwise answered as it should. Well-behaved, slow, leaving and bad clients,
and requests that meet the fake upstream's faults.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp


@dataclass(frozen=True)
class Limits:
    """The proxy's limits the clients expect to meet (its config in the soak)."""

    header_timeout_s: float
    body_timeout_s: float


@dataclass
class Tally:
    """What the clients sent and saw."""

    requests: dict[str, int] = field(default_factory=dict)
    """Requests whose head reached slotwise, by behaviour: each must leave one record."""
    silent_sockets: int = 0
    """Sockets that never finished a request head (idle, or dripping one)."""
    silent_closed: int = 0
    """Of those, how many slotwise closed within its header time limit."""
    unexpected: list[str] = field(default_factory=list)
    unexpected_count: int = 0

    @property
    def sent(self) -> int:
        return sum(self.requests.values())

    def count(self, behaviour: str) -> None:
        self.requests[behaviour] = self.requests.get(behaviour, 0) + 1

    def wrong(self, behaviour: str, what: str) -> None:
        self.unexpected_count += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(f"{behaviour}: {what}")


def chat(model: str, tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": model, "max_tokens": tokens, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]}


class Clients:
    """One soak's clients: `behaviours[name](tally)` makes one request of that kind."""

    def __init__(self, url: str, session: aiohttp.ClientSession, limits: Limits) -> None:
        self.url = url
        self.session = session
        self.limits = limits
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.behaviours: dict[str, Callable[[Tally], Awaitable[None]]] = {
            "stream": lambda t: self._stream(t, "stream", "fast", 30),
            "slow-stream": lambda t: self._stream(t, "slow-stream", "slow", 15),
            "slow-reader": self._slow_reader,
            "leaver": self._leaver,
            "plain": self._plain,
            "upstream-reset": lambda t: self._fault(t, "upstream-reset", "reset", 200),
            "upstream-garbled": lambda t: self._fault(t, "upstream-garbled", "garbled", 200),
            "upstream-silent": lambda t: self._fault(t, "upstream-silent", "silent", 504),
            "upstream-error": lambda t: self._fault(t, "upstream-error", "error", 500),
            "bad-json": self._bad_json,
            "drip-body": self._drip_body,
            "idle-socket": lambda t: self._silent(t, drip=False),
            "drip-head": lambda t: self._silent(t, drip=True),
        }

    async def long_stream(self, tally: Tally, tokens: int) -> None:
        """A stream that stays open for a while (the others' prefills overlap it)."""
        await self._stream(tally, "long-stream", "long", tokens)

    async def _stream(self, tally: Tally, name: str, model: str, tokens: int) -> None:
        tally.count(name)
        async with self.session.post(self.url + "/v1/chat/completions",
                                     json=chat(model, tokens)) as response:
            body = await response.read()
        if response.status != 200 or not body.endswith(b"data: [DONE]\n\n"):
            tally.wrong(name, f"HTTP {response.status}, ends {body[-40:]!r}")

    async def _slow_reader(self, tally: Tally) -> None:
        tally.count("slow-reader")
        async with self.session.post(self.url + "/v1/chat/completions",
                                     json=chat("fast", 40)) as response:
            body = b""
            while piece := await response.content.read(256):
                body += piece
                await asyncio.sleep(0.02)
        if not body.endswith(b"data: [DONE]\n\n"):
            tally.wrong("slow-reader", f"ends {body[-40:]!r}")

    async def _leaver(self, tally: Tally) -> None:
        tally.count("leaver")
        async with self.session.post(self.url + "/v1/chat/completions",
                                     json=chat("slow", 50)) as response:
            await response.content.readany()
            response.close()  # gone mid-stream

    async def _plain(self, tally: Tally) -> None:
        tally.count("plain")
        async with self.session.post(self.url + "/v1/chat/completions",
                                     json=chat("plain", 20, stream=False)) as response:
            await response.read()
        if response.status != 200:
            tally.wrong("plain", f"HTTP {response.status}")

    async def _fault(self, tally: Tally, name: str, model: str, status: int) -> None:
        tally.count(name)
        async with self.session.post(self.url + "/v1/chat/completions",
                                     json=chat(model, 20)) as response:
            body = await response.read()
        if response.status != status or (status == 200 and b'"error"' not in body):
            tally.wrong(name, f"HTTP {response.status}, ends {body[-60:]!r}")

    async def _raw(self, head: bytes, body: bytes) -> tuple[asyncio.StreamReader,
                                                             asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(head + body)
        await writer.drain()
        return reader, writer

    def _head(self, length: int) -> bytes:
        return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
                "Connection: close\r\n\r\n").encode()

    async def _status_of(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         timeout: float) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                line = await reader.readline()
        except TimeoutError:
            line = b"(no answer)"
        finally:
            writer.close()
        return line.strip()

    async def _bad_json(self, tally: Tally) -> None:
        tally.count("bad-json")
        reader, writer = await self._raw(self._head(5), b"{nope")
        line = await self._status_of(reader, writer, 10)
        if not line.startswith(b"HTTP/1.1 400"):
            tally.wrong("bad-json", repr(line))

    async def _drip_body(self, tally: Tally) -> None:
        """Sends the head and part of the body, then nothing: answered 408 at the body limit."""
        tally.count("drip-body")
        reader, writer = await self._raw(self._head(200), b'{"model": "fast", ')
        line = await self._status_of(reader, writer, self.limits.body_timeout_s + 5)
        if not line.startswith(b"HTTP/1.1 408"):
            tally.wrong("drip-body", repr(line))

    async def _silent(self, tally: Tally, *, drip: bool) -> None:
        """A socket that never completes a request head: slotwise must close it in time."""
        tally.silent_sockets += 1
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            closed = await closed_within(reader, writer, self.limits.header_timeout_s + 3, drip=drip)
        finally:
            writer.close()
        if closed:
            tally.silent_closed += 1
        else:
            tally.wrong("drip-head" if drip else "idle-socket", "not closed by slotwise in time")


async def closed_within(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float,
                        *, drip: bool) -> bool:
    """Whether the server closes this socket within `timeout` while the client sends nothing, or
    (`drip`) a request head a line at a time that never ends."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    if drip:
        writer.write(b"GET /health HTTP/1.1\r\n")
    try:
        while loop.time() < deadline:
            if drip:
                writer.write(b"X-Drip: 1\r\n")
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1), 0.3) == b"":
                    return True
    except ConnectionError:  # reset by the server: closed all the same
        return True
    return False
