"""The catch-all handler: one HTTP request's trip through the proxy, and its one timing record.

It sequences the parts: the intake reads the body, the gate admits, the request goes upstream, the
relay moves the answer while the observer makes the facts, and `finish` writes the record whatever
happened on the way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from yarl import URL

from proxy.record.flight import Flight
from proxy.record.schema import Record, build_record
from proxy.record.timing import RequestTimer
from proxy.request.endpoints import classify, reads_body
from proxy.request.errors import PROXY_ERROR_HEADER, ProxyError
from proxy.request.headers import (
    CLIENT_HEADER,
    PURPOSE_HEADER,
    REQUEST_ID_HEADER,
    client_response_headers,
    request_id,
    upstream_request_headers,
)
from proxy.request.intake import Intake
from proxy.request.observer import Observer
from proxy.request.relay import Relay, open_upstream
from proxy.state import STATE, ProxyState

log = logging.getLogger("slotwise.proxy")


async def handle(request: web.Request) -> web.StreamResponse:
    """Every path and method not served by slotwise itself comes here."""
    state = request.app[STATE]
    exchange = Exchange(request, state)
    try:
        return await exchange.run()
    except ProxyError as exc:
        return exchange.fail(exc)
    except ConnectionResetError:
        exchange.flight.outcome = "client_gone"
        return exchange.response or web.Response(status=499)
    except asyncio.CancelledError:
        exchange.flight.outcome = "shutdown" if state.stopping else "client_gone"
        raise
    except Exception as exc:
        log.exception("request %s failed inside slotwise", exchange.flight.id)
        return exchange.fail(ProxyError(f"internal error: {type(exc).__name__}: {exc}"))
    finally:
        exchange.finish()


class Exchange:
    """One request's trip through the proxy."""

    def __init__(self, request: web.Request, state: ProxyState) -> None:
        self.request = request
        self.state = state
        now = state.clock()
        self.flight = Flight(
            id=request_id(request.headers), kind=classify(request.method, request.path),
            method=request.method, endpoint=request.path, wall_start=time.time(),
            config_gen=state.config_gen, timer=RequestTimer(arrived=now),
            purpose=request.headers.get(PURPOSE_HEADER) or None,
            client=request.headers.get(CLIENT_HEADER) or None)
        self.response: web.StreamResponse | None = None
        self.relay: Relay | None = None
        state.registry.add(self.flight, now)

    async def run(self) -> web.StreamResponse:
        intake = Intake(self.request, self.flight, self.state.max_body_bytes)
        if not reads_body(self.flight.kind):
            return await self._forward(await intake.plain_body(), drop_progress=False)
        model = await intake.model_body(self.state.forced_lora())
        await self.state.gate.admit(self.flight, model.rewritten.body)
        return await self._forward(model.data, drop_progress=model.rewritten.progress_added)

    async def _forward(self, data: Any, *, drop_progress: bool) -> web.StreamResponse:
        state, flight, request = self.state, self.flight, self.request
        headers = upstream_request_headers(
            request.headers, request.headers.items(), rid=flight.id, peer=request.remote,
            scheme=request.scheme, body_rewritten=isinstance(data, bytes),
            measured=reads_body(flight.kind))
        observer = Observer(flight, state.registry, drop_progress=drop_progress)
        observer.sent(state.clock())
        upstream = await open_upstream(
            state.session, request.method, URL(state.upstream_url + request.raw_path,
                                               encoded=True),
            headers=headers, data=data, read_timeout_s=state.config.upstream.read_timeout_s)
        is_sse = observer.headers(upstream.status, upstream.content_type, state.clock())
        self.relay = relay = Relay(upstream, web.StreamResponse(), observer)
        response = relay.client
        response.set_status(upstream.status, upstream.reason)
        response.headers.extend(client_response_headers(
            upstream.headers, upstream.headers.items(), rid=flight.id,
            keep_length=not (is_sse and drop_progress)))
        self.response = response
        await response.prepare(request)
        if is_sse:
            await relay.stream(state.clock)
        else:
            await relay.body()
        observer.ended()
        await response.write_eof()
        return response

    def fail(self, exc: ProxyError) -> web.StreamResponse:
        """Answer with the proxy's own error, if the client has not had a response yet."""
        flight = self.flight
        flight.outcome, flight.error = exc.outcome, exc.message
        if self.response is not None and self.response.prepared:
            return self.response
        flight.status = exc.status
        body = exc.body_bytes()
        flight.bytes_out = len(body)
        return web.Response(status=exc.status, body=body, content_type="application/json",
                            headers={REQUEST_ID_HEADER: flight.id, PROXY_ERROR_HEADER: exc.type})

    def _close_upstream(self) -> None:
        if self.relay is not None:
            self.relay.close_upstream()

    def finish(self) -> None:
        """Close what is open and write the one record of this request.

        Nothing here may keep the record from being written: a failure in a step is logged and
        the next steps still run.
        """
        now = self.state.clock()
        self.flight.timer.on_end(now)
        for step in (self._close_upstream, lambda: self.state.registry.finish(self.flight, now)):
            try:
                step()
            except Exception:
                log.exception("finishing request %s: %s failed", self.flight.id, step)
        try:
            record = build_record(self.flight)
        except Exception:  # write what is certain
            log.exception("building the record of %s failed", self.flight.id)
            record = Record(id=self.flight.id, outcome="proxy_error",
                            error="slotwise could not build this record")
        self.state.timing_log.write(record)
        self.state.observe_record(record)
