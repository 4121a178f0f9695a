"""Talks to the upstream: sends one request, and relays its response to the client as it comes,
feeding a copy of a stream to the parser so that every moment of the request is timed.

This is the hot path: per chunk it parses complete events, notes what they say, and writes the
events the client should see in one write.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.endpoints import Kind
from proxy.errors import (
    BadUpstreamStream,
    ProxyError,
    UpstreamTimeout,
    UpstreamUnavailable,
    sse_error_event,
)
from proxy.inflight import Flight, Phase, Registry
from proxy.record import Outcome
from proxy.signals import Signal, What, interpret
from proxy.sse import SseParser
from proxy.upstream_call import DEAD_CONNECTION, send
from proxy.usage import prompt_counts

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


class Relay:
    """Relays one upstream response to one client response and observes it on the way."""

    def __init__(self, upstream: aiohttp.ClientResponse, client: web.StreamResponse, *,
                 flight: Flight, out: Outcome, registry: Registry, kind: Kind, clock: Clock,
                 drop_progress: bool) -> None:
        self.upstream = upstream
        self.client = client
        self.flight = flight
        self.out = out
        self.registry = registry
        self.kind = kind
        self.clock = clock
        self.drop_progress = drop_progress
        self.complete = False
        self.reusable = True  # llama-server closes its end after a stream: never pool that one

    async def _write(self, data: bytes) -> None:
        await self.client.write(data)
        self.out.bytes_out += len(data)

    async def _read(self) -> bytes:
        """The next piece of the upstream body (b"" at its end); a failed read is a
        `BadUpstreamStream`."""
        try:
            return await self.upstream.content.readany()
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise BadUpstreamStream("the upstream went silent mid-response") from exc
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise BadUpstreamStream(
                f"the upstream broke off the response ({type(exc).__name__})") from exc

    async def stream(self) -> None:
        """Relay an SSE response event by event."""
        self.reusable = False
        parser = SseParser()
        try:
            while chunk := await self._read():
                now = self.clock()
                keep: list[bytes] = []
                for event in parser.feed(chunk):
                    signal = interpret(self.kind, event)
                    self._observe(signal, now)
                    if not (self.drop_progress and signal.what is What.PROGRESS):
                        keep.append(event.raw)
                if keep:
                    await self._write(b"".join(keep))
            if parser.pending:
                await self._write(parser.pending)
            self.complete = True
        except ProxyError as exc:
            self.out.outcome, self.out.error = exc.outcome, exc.message
            await self._write(sse_error_event(exc))

    async def body(self) -> None:
        """Relay a plain response as it comes; parse it at the end for the server's figures."""
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
            self.out.outcome, self.out.error = exc.outcome, exc.message
            return
        if size <= KEEP_BODY_BYTES:
            self._observe_body(b"".join(kept))

    def _observe(self, signal: Signal, now: float) -> None:
        flight, timer = self.flight, self.flight.timer
        what = signal.what
        if what is What.TOKEN:
            timer.on_token(now)
            flight.decoded += 1
            if flight.decoded == 1:
                self.registry.move(flight, Phase.DECODING, now)
        elif what is What.PROGRESS and signal.progress is not None:
            self._observe_progress(signal.progress, now)
        elif what is What.ERROR:
            self.out.outcome, self.out.error = "upstream_error", signal.error
        elif what is What.MALFORMED:
            raise BadUpstreamStream(f"the upstream sent a malformed event: {signal.error}")
        if signal.timings is not None:
            self._observe_timings(signal.timings)
        if signal.prompt_tokens is not None:
            flight.prompt_tokens = signal.prompt_tokens
        if signal.new_tokens is not None and self.out.timings is None:  # timings rule if given
            flight.new_tokens = signal.new_tokens

    def _observe_progress(self, progress: dict[str, Any], now: float) -> None:
        flight = self.flight
        first = not flight.timer.progress_seen
        flight.timer.on_progress(now, progress)
        total, cache = progress.get("total"), progress.get("cache")
        processed = progress.get("processed")
        if isinstance(processed, int):
            flight.prefill_done_tokens = processed
        if first and isinstance(total, int) and isinstance(cache, int):
            flight.prompt_tokens = total
            flight.new_tokens = total - cache

    def _observe_timings(self, timings: dict[str, Any]) -> None:
        self.out.timings = timings
        prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
        if isinstance(prompt_n, int):
            self.flight.new_tokens = prompt_n
            if isinstance(cache_n, int):
                self.flight.prompt_tokens = prompt_n + cache_n

    def _observe_body(self, data: bytes) -> None:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        if self.upstream.status >= 400:
            error = obj.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            self.out.error = str(message or obj)[:500]
            return
        timings = obj.get("timings")
        if isinstance(timings, dict):
            self._observe_timings(timings)
        total, computed = prompt_counts(self.kind, obj)
        if total is not None:
            self.flight.prompt_tokens = total
        if computed is not None and not isinstance(timings, dict):
            self.flight.new_tokens = computed

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
