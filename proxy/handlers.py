"""The catch-all handler: turns one HTTP request into an upstream call and back, and makes sure it
leaves exactly one timing record, whatever happens to it.

It only translates: decisions live in the gate and the rewrites, I/O in `forward`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from aiohttp import web
from yarl import URL

from proxy.endpoints import GENERATING, classify, reads_body
from proxy.errors import PROXY_ERROR_HEADER, BadRequest, PayloadTooLarge, ProxyError
from proxy.forward import Relay, open_upstream, read_limited
from proxy.headers import (
    CLIENT_HEADER,
    PURPOSE_HEADER,
    REQUEST_ID_HEADER,
    client_response_headers,
    request_id,
    upstream_request_headers,
)
from proxy.inflight import Flight, Phase
from proxy.record import Outcome, build_record
from proxy.rewrite import client_key, rewrite_body
from proxy.state import STATE, ProxyState
from proxy.timing import RequestTimer

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
        exchange.out.outcome = "client_gone"
        return exchange.response or web.Response(status=499)
    except asyncio.CancelledError:
        exchange.out.outcome = "shutdown" if state.stopping else "client_gone"
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
        self.kind = classify(request.method, request.path)
        now = state.clock()
        self.flight = Flight(
            id=request_id(request.headers), kind=self.kind, stream=False,
            timer=RequestTimer(arrived=now),
            purpose=request.headers.get(PURPOSE_HEADER) or None,
            client=request.headers.get(CLIENT_HEADER) or None,
        )
        self.out = Outcome(method=request.method, endpoint=request.path,
                           wall_start=time.time(), config_gen=state.config_gen)
        self.response: web.StreamResponse | None = None
        self.relay: Relay | None = None
        state.registry.add(self.flight, now)

    async def run(self) -> web.StreamResponse:
        if reads_body(self.kind):
            data, drop_progress = await self._prepare_model_request()
        else:
            data, drop_progress = await self._plain_body(), False
        return await self._forward(data, drop_progress)

    async def _prepare_model_request(self) -> tuple[bytes, bool]:
        raw = await self._read_body()
        body = self._decode(raw)
        flight, out = self.flight, self.out
        flight.stream = body.get("stream") is True
        flight.client = client_key(body, flight.client)
        rewritten = rewrite_body(self.kind, body, forced_lora=self.state.forced_lora())
        out.lora_in, flight.lora_out = rewritten.lora_in, rewritten.lora_out
        out.lora_rewritten, out.progress_added = rewritten.lora_rewritten, rewritten.progress_added
        try:
            admission = await self.state.gate.admit(flight, self.kind, rewritten.body)
        except asyncio.CancelledError:
            if flight.phase is Phase.HELD:  # the record must say it left while held
                out.prefill_plan = "held"
                out.held_ms = flight.timer.ms(flight.timer.arrived, self.state.clock()) or 0.0
            raise
        out.prefill_plan, out.held_ms, out.pieces = (admission.plan, admission.held_ms,
                                                     admission.pieces)
        out.est_prompt_tokens, out.policy_note = admission.est_prompt_tokens, admission.note
        flight.est_new_tokens = admission.est_new_tokens
        data = orjson.dumps(rewritten.body) if rewritten.changed else raw
        return data, rewritten.progress_added

    async def _read_body(self) -> bytes:
        limit = self.state.max_body_bytes
        length = self.request.content_length
        if length is not None and length > limit:
            raise self._too_large(length)
        raw = await read_limited(self.request.content, limit)
        if raw is None:
            raise self._too_large(None)
        self.out.bytes_in = len(raw)
        return raw

    def _too_large(self, length: int | None) -> PayloadTooLarge:
        size = f"{length} bytes" if length is not None else "more"
        return PayloadTooLarge(f"the request body ({size}) is over the limit of "
                               f"{self.state.max_body_bytes} bytes (listen.max_body_mb)")

    def _decode(self, raw: bytes) -> dict[str, Any]:
        where = f"{self.request.method} {self.request.path}"
        if not raw.strip():
            raise BadRequest(f"{where} needs a JSON object as its body; the body is empty")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the body of {where} is not valid JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise BadRequest(f"the body of {where} must be a JSON object, "
                             f"got a JSON {type(body).__name__}")
        return body

    async def _plain_body(self) -> Any:
        """A body slotwise need not read: streamed through when its length is known."""
        request = self.request
        if not request.body_exists:
            return None
        length = request.content_length
        if length is not None:
            if length > self.state.max_body_bytes:
                raise self._too_large(length)
            self.out.bytes_in = length
            return request.content
        return await self._read_body()

    async def _forward(self, data: Any, drop_progress: bool) -> web.StreamResponse:
        state, flight, request = self.state, self.flight, self.request
        headers = upstream_request_headers(
            request.headers, request.headers.items(), rid=flight.id, peer=request.remote,
            scheme=request.scheme, body_rewritten=isinstance(data, bytes),
            measured=reads_body(self.kind))
        flight.timer.on_sent(state.clock())
        state.registry.move(flight, Phase.QUEUED if flight.stream else Phase.WAITING,
                            state.clock())
        upstream = await open_upstream(
            state.session, request.method, URL(state.upstream_url + request.raw_path,
                                               encoded=True),
            headers=headers, data=data, read_timeout_s=state.config.upstream.read_timeout_s)
        now = state.clock()
        is_sse = upstream.content_type == "text/event-stream"
        prefill_starts = is_sse and upstream.status == 200 and self.kind in GENERATING
        flight.timer.on_headers(now, prefill_starts=prefill_starts)
        if prefill_starts:
            state.registry.move(flight, Phase.PREFILLING, now)
        self.relay = relay = Relay(upstream, web.StreamResponse(), flight=flight, out=self.out,
                                   registry=state.registry, kind=self.kind, clock=state.clock,
                                   drop_progress=drop_progress)
        return await self._respond(relay, is_sse)

    async def _respond(self, relay: Relay, is_sse: bool) -> web.StreamResponse:
        upstream, response = relay.upstream, relay.client
        response.set_status(upstream.status, upstream.reason)
        response.headers.extend(client_response_headers(
            upstream.headers, upstream.headers.items(), rid=self.flight.id,
            keep_length=not (is_sse and relay.drop_progress)))
        self.out.status = upstream.status
        self.response = response
        await response.prepare(self.request)
        if is_sse:
            await relay.stream()
        else:
            await relay.body()
            self._place_unseen_prefill()
        if upstream.status >= 400 and self.out.outcome == "done":
            self.out.outcome = "upstream_error"
        await response.write_eof()
        return response

    def _place_unseen_prefill(self) -> None:
        """A non-streamed answer shows its prefill only in its totals: put it on the time axis
        afterwards (it ended `predicted_ms` before the answer and lasted `prompt_ms`), so the
        requests still in flight see it in their records' overlaps."""
        timings, answered = self.out.timings, self.flight.timer.headers
        if self.kind not in GENERATING or timings is None or answered is None:
            return
        prompt_ms, predicted_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
        if not isinstance(prompt_ms, int | float) or not isinstance(predicted_ms, int | float):
            return
        ended = answered - predicted_ms / 1000.0
        self.state.registry.start_prefill(self.flight, ended - prompt_ms / 1000.0)
        self.flight.prefill_end = ended

    def _close_upstream(self) -> None:
        if self.relay is not None:
            self.relay.close_upstream()

    def fail(self, exc: ProxyError) -> web.StreamResponse:
        """Answer with the proxy's own error, if the client has not had a response yet."""
        self.out.outcome, self.out.error = exc.outcome, exc.message
        if self.response is not None and self.response.prepared:
            return self.response
        self.out.status = exc.status
        body = exc.body_bytes()
        self.out.bytes_out = len(body)
        return web.Response(status=exc.status, body=body, content_type="application/json",
                            headers={REQUEST_ID_HEADER: self.flight.id,
                                     PROXY_ERROR_HEADER: exc.type})

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
            record = build_record(self.flight, self.out)
        except Exception:  # write what is certain
            log.exception("building the record of %s failed", self.flight.id)
            record = {"id": self.flight.id, "outcome": "proxy_error",
                      "error": "slotwise could not build this record"}
        self.state.timing_log.write(record)
        self.state.observe_record(record)
