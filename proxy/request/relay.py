"""Talks to the upstream: sends one request, and relays its response to the client as it comes.

It only moves bytes. Each complete stream event, and a plain body at its end, is shown to the
request's `Observer`, which makes the facts; per chunk the events the client should see go out in
one write (this is the hot path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from proxy.request.errors import (
    BadUpstreamStream,
    ProxyError,
    UpstreamTimeout,
    UpstreamUnavailable,
    sse_error_event,
)
from proxy.request.observer import Observer
from proxy.request.sse import EventTooLarge, SseParser
from proxy.upstream import DEAD_CONNECTION, send

Clock = Callable[[], float]
KEEP_BODY_BYTES = 4 << 20  # a non-streamed answer larger than this is relayed but not parsed


async def open_upstream(session: aiohttp.ClientSession, method: str, url: Any, *,
                        headers: Any, data: Any, read_timeout_s: float) -> aiohttp.ClientResponse:
    """Send the request; return once the upstream's response headers are in. A request whose
    body can be sent again is retried once after a dead pooled connection (`upstream_call`)."""
    replayable = data is None or isinstance(data, bytes)
    try:
        return await send(session, method, url, replayable=replayable, headers=headers, data=data,
                          allow_redirects=False)
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout(f"no answer from the upstream within {read_timeout_s:g} s") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamUnavailable(f"cannot connect to the upstream "
                                  f"{exc.host}:{exc.port}: {exc.os_error.strerror or exc}") from exc
    except DEAD_CONNECTION as exc:
        raise UpstreamUnavailable(f"the upstream closed the connection before answering "
                                  f"({type(exc).__name__})") from exc
    except aiohttp.ClientResponseError as exc:  # its head could not be parsed
        raise BadUpstreamStream(f"the upstream's answer is not valid HTTP: {parse_error(exc)}") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamUnavailable(f"the upstream could not be asked ({type(exc).__name__})") from exc


def parse_error(exc: aiohttp.ClientResponseError) -> str:
    """The parser's reason, without the excerpt of the upstream's bytes aiohttp appends to it, and
    without the URL (the upstream's address is not for clients)."""
    first = exc.message.strip().splitlines()[0].rstrip(":") if exc.message.strip() else ""
    return first or f"HTTP {exc.status}"


class Relay:
    """Moves one upstream response to one client response, and shows every piece to the observer."""

    def __init__(self, upstream: aiohttp.ClientResponse, client: web.StreamResponse,
                 observer: Observer, *, max_event_mb: float) -> None:
        self.upstream = upstream
        self.client = client
        self.observer = observer
        self.max_event_mb = max_event_mb
        self.complete = False
        self.reusable = True  # llama-server closes its end after a stream: never pool that one
        self.sse = False
        """The response is a stream of events (`stream`): an error can still be told in it."""

    async def _write(self, data: bytes) -> None:
        await self.client.write(data)
        self.observer.wrote(len(data))

    async def _read(self) -> bytes:
        """The next piece of the upstream body (b"" at its end); a failed read is a
        `BadUpstreamStream`."""
        try:
            return await self.upstream.content.readany()
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise BadUpstreamStream("the upstream went silent mid-response") from exc
        except aiohttp.ClientError as exc:
            raise BadUpstreamStream(
                f"the upstream broke off the response ({type(exc).__name__})") from exc

    async def stream(self, clock: Clock) -> None:
        """Relay an SSE response event by event; the observer says which events the client sees."""
        self.reusable, self.sse = False, True
        parser = SseParser(int(self.max_event_mb * 1024 * 1024))
        observer = self.observer
        try:
            while chunk := await self._read():
                now = clock()
                try:
                    events, too_large = parser.feed(chunk), None
                except EventTooLarge as exc:  # the events before it still go out
                    events, too_large = exc.events, exc
                keep = [event.raw for event in events if observer.event(event, now)]
                if keep:
                    await self._write(b"".join(keep))
                if too_large is not None:
                    raise BadUpstreamStream(
                        f"the upstream sent a stream event larger than {self.max_event_mb:g} MiB "
                        "(upstream.max_event_mb); the stream was cut there") from too_large
            if parser.pending:
                await self._write(parser.pending)
            self.complete = True
        except ProxyError as exc:
            observer.broke(exc.outcome, exc.message)
            await self._write(sse_error_event(exc))

    async def body(self) -> None:
        """Relay a plain response as it comes; the observer gets it whole at the end."""
        kept: list[bytes] = []
        size = 0
        try:
            while chunk := await self._read():
                if size <= KEEP_BODY_BYTES:
                    kept.append(chunk)
                size += len(chunk)
                await self._write(chunk)
            self.complete = True
        except ProxyError as exc:
            self.observer.broke(exc.outcome, exc.message)
            return
        self.observer.body(b"".join(kept) if size <= KEEP_BODY_BYTES else None)

    async def end_stream(self, error: ProxyError) -> None:
        """Cut a stream short: `error` as its last event, and the end of the body (a stream cut
        between two events; the upstream is closed by `close_upstream`)."""
        self.observer.broke(error.outcome, error.message)
        await self._write(sse_error_event(error))
        await self.client.write_eof()

    def close_upstream(self) -> None:
        """Close the upstream connection if the response did not finish: llama-server then
        cancels the task (a connection returned to the pool would keep it generating)."""
        if not (self.complete and self.reusable):
            self.upstream.close()


async def read_limited(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, or None if it is larger than `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    async for chunk in content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)
