"""The catch-all handler: one HTTP request's trip through the proxy, and its one timing record.

It sequences the parts: the intake reads the body, the gate admits, the request goes upstream, the
relay moves the answer while the observer makes the facts; `guaranteed` (`proxy/request/trip.py`)
answers whatever happens and `finish` writes the record.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from aiohttp import web
from yarl import URL

from proxy.record.clientstrings import clean_text, safe_text
from proxy.record.flight import Flight
from proxy.record.kind import Kind
from proxy.record.node import node_name
from proxy.record.outcome import Outcome
from proxy.record.schema import Record, build_record
from proxy.record.timing import RequestTimer
from proxy.request.access import Allow, Refuse, decide, forwarded_headers
from proxy.request.admission import ADMISSION
from proxy.request.endpoints import classify, reads_body
from proxy.request.errors import BadRequest, ProxyError, ShuttingDown
from proxy.request.headers import (
    CLIENT_HEADER,
    PURPOSE_HEADER,
    client_request_id,
    client_response_headers,
    upstream_request_headers,
)
from proxy.request.intake import Intake
from proxy.request.observer import Observer
from proxy.request.relay import Relay, open_upstream
from proxy.request.trip import failed, guaranteed
from proxy.state import STATE, ProxyState

log = logging.getLogger("slotwise.proxy")


async def handle(request: web.Request) -> web.StreamResponse:
    """Every path and method not served by slotwise itself comes here."""
    state = request.app[STATE]
    return await guaranteed(Exchange(request, state), state)


class Exchange:
    """One request's trip through the proxy."""

    def __init__(self, request: web.Request, state: ProxyState) -> None:
        self.request = request
        self.state = state
        now = state.clock()
        config = state.config
        self.access = decide(config.access, config.upstream.api_key, request.method,
                             request.raw_path, request.headers)
        rid = state.ids.issue(client_request_id(request.headers),
                              lambda taken: state.registry.get(taken) is not None)
        self.origin_form = request.raw_path.startswith("/")
        self.flight = Flight(
            id=rid, kind=classify(request.method, request.path) if self.origin_form else Kind.OTHER,
            method=request.method, endpoint=request.path, wall_start=time.time(),
            config_gen=state.config_gen, timer=RequestTimer(arrived=now),
            purpose=clean_text(request.headers.get(PURPOSE_HEADER)),
            client=clean_text(request.headers.get(CLIENT_HEADER)), node=node_name(config))
        if isinstance(self.access, Allow) and self.access.client:  # the key's name, not a header
            self.flight.client = self.access.client
        self.response: web.StreamResponse | None = None
        self.relay: Relay | None = None
        state.registry.add(self.flight, now)

    async def run(self) -> web.StreamResponse:
        if isinstance(self.access, Refuse):  # before any work: no body read, estimate or piece
            raise self.access.error()
        if not self.origin_form:  # `GET http://host/x`: a forward proxy's request, not ours
            target = safe_text(self.request.raw_path, 200)
            raise BadRequest(f"the request target {target!r} is not a path: slotwise is a reverse "
                             "proxy and takes origin-form targets such as /v1/chat/completions")
        intake = Intake(self.request, self.flight, self.state.max_body_bytes,
                        self.state.config.listen.body_timeout_s)
        if not reads_body(self.flight.kind):
            body = await intake.plain_body()
            try:
                return await self._forward(body, drop_progress=False)
            except Exception:
                if intake.too_slow is not None:  # the client's body failed, not the upstream
                    raise intake.too_slow from None
                raise
        model = await intake.model_body(self.state.forced_lora())
        await self.request.app[ADMISSION].admit(self.flight, model.rewritten.body)
        return await self._forward(model.data, drop_progress=model.rewritten.progress_added)

    async def _forward(self, data: Any, *, drop_progress: bool) -> web.StreamResponse:
        state, flight, request = self.state, self.flight, self.request
        headers = upstream_request_headers(
            request.headers, request.headers.items(), rid=flight.id, peer=request.remote,
            scheme=request.scheme, body_rewritten=isinstance(data, bytes),
            measured=reads_body(flight.kind))
        auth = self.access.upstream_auth(state.config.upstream.auth_headers()) \
            if isinstance(self.access, Allow) else None
        if auth is not None:
            headers = forwarded_headers(headers, auth)
        observer = Observer(flight, state.registry, drop_progress=drop_progress)
        observer.sent(state.clock())
        upstream = await open_upstream(
            state.session, request.method, URL(state.upstream_url + request.raw_path,
                                               encoded=True),
            headers=headers, data=data, read_timeout_s=state.config.upstream.read_timeout_s)
        is_sse = observer.headers(upstream.status, upstream.content_type, state.clock())
        self.relay = relay = Relay(upstream, web.StreamResponse(), observer,
                                   max_event_mb=state.config.upstream.max_event_mb)
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
        if self.response is not None and self.response.prepared:
            self.flight.outcome, self.flight.error = exc.outcome, exc.message
            return self.response
        return failed(self.flight, exc)

    def can_answer(self) -> bool:
        """Whether the client can still be told why the request ends: it has no answer yet, or its
        answer is a stream (a plain body under way has no way to say so)."""
        unanswered = self.response is None or not self.response.prepared
        return unanswered or (self.relay is not None and self.relay.sse)

    async def cut(self, error: ShuttingDown) -> web.StreamResponse:
        """The shutdown grace period is over and this request was cancelled (`can_answer`): answer
        it with slotwise's 503 if it has no answer yet (held, or waiting for the upstream), else
        end its stream with an error event and a clean end of the body."""
        if self.response is None or not self.response.prepared or self.relay is None:
            return self.fail(error)
        with contextlib.suppress(OSError):  # the client left as well: nothing more to tell
            await self.relay.end_stream(error)
        return self.response

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
            record = Record(id=self.flight.id, outcome=Outcome.PROXY_ERROR,
                            error="slotwise could not build this record")
        self.state.emit(record, peer=self.request.remote, sample=True)
