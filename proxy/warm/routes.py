"""The warm endpoints: `POST /slotwise/warm/<endpoint>` queues a warm-up and answers 202 at once;
`GET` and `DELETE /slotwise/warm/<id>` report on one and cancel it. They translate HTTP to the
warmer's values and back; a POST that is refused gets its record here, an accepted one when it ends.

Who may call them: whoever may call the model endpoints (`[access]`, `access.decide`). With client
keys, a warm-up is seen and cancelled only by its own client (or the admin key).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
from aiohttp import web

from proxy.cluster.node import node_name
from proxy.cluster.render import render_error
from proxy.config import ADMIN_CLIENT
from proxy.estimate import EstimateError
from proxy.record.clientstrings import clean_text
from proxy.record.flight import Flight
from proxy.request.access import Allow, Refuse, decide
from proxy.request.endpoints import classify
from proxy.request.errors import PROXY_ERROR_HEADER, ProxyError, Rejected
from proxy.request.headers import CLIENT_HEADER, PURPOSE_HEADER, REQUEST_ID_HEADER
from proxy.request.intake import Intake
from proxy.state import STATE, ProxyState
from proxy.warm.prefix import WARM_KINDS
from proxy.warm.record import warm_flight, warm_record
from proxy.warm.values import WarmRefused, WarmUp
from proxy.warm.views import warm_view
from proxy.warm.warmer import Warmer

PREFIX = "/slotwise/warm/"
WARMER = web.AppKey("slotwise_warmer", Warmer)
VALID = "/v1/chat/completions, /v1/completions, /completion, /v1/messages, /v1/responses"


class TooManyWarmUps(ProxyError):
    status = 429
    type = "slotwise_too_many_warmups"
    outcome = "rejected"


class WarmOff(Rejected):
    """`warm.enabled` is false."""


class NoSuchWarmUp(ProxyError):
    status = 404
    type = "not_found_error"
    outcome = "bad_request"


def error_response(error: ProxyError, rid: str | None = None) -> web.Response:
    headers = {PROXY_ERROR_HEADER: error.type, "Cache-Control": "no-store", **error.headers()}
    if rid is not None:
        headers[REQUEST_ID_HEADER] = rid
    return web.Response(status=error.status, body=error.body_bytes(), content_type="application/json",
                        headers=headers)


def warm_kind(endpoint: str) -> str:
    kind = str(classify("POST", "/" + endpoint))
    if kind not in WARM_KINDS:
        raise NoSuchWarmUp(f"{PREFIX}{endpoint}: cannot warm /{endpoint} (valid: {PREFIX} followed by "
                           f"one of {VALID} and their aliases)")
    return kind


async def post_warm(request: web.Request) -> web.Response:
    state, warmer = request.app[STATE], request.app[WARMER]
    verdict = _verdict(request, state)
    flight = _flight(request, state, verdict)
    handed_over = False
    try:
        if isinstance(verdict, Refuse):
            raise verdict.error()
        if not state.config.warm.enabled:
            raise WarmOff("warm-ups are off (warm.enabled = false in slotwise's config)")
        kind = warm_kind(request.match_info["endpoint"])
        intake = Intake(request, flight, state.max_body_bytes, state.config.listen.body_timeout_s)
        model = await intake.model_body(state.forced_lora())
        try:
            warm = await warmer.submit(flight, kind, model.rewritten.body, model.rewritten.lora_out)
        except EstimateError as exc:
            raise render_error(exc) from exc
        except WarmRefused as exc:
            raise TooManyWarmUps(str(exc)) from exc
        handed_over = True
        return _accepted(flight, warm, warmer)
    except ProxyError as exc:
        flight.status, flight.outcome, flight.error = exc.status, exc.outcome, exc.message
        flight.bytes_out = len(exc.body_bytes())
        return error_response(exc, flight.id)
    except asyncio.CancelledError:
        flight.outcome = "shutdown" if state.stopping else "client_gone"
        raise
    finally:
        if not handed_over:  # refused: its one record now (an accepted one's when it ends)
            flight.timer.on_end(state.clock())
            state.emit(warm_record(flight, None))


def _accepted(flight: Flight, warm: WarmUp, warmer: Warmer) -> web.Response:
    private = warmer.isolated()
    view = warm_view(warm, warmer.knobs(), warmer.now(), private=private)
    body = orjson.dumps({**view, "status_url": PREFIX + warm.id})
    flight.bytes_out = len(body)
    return web.Response(status=202, body=body, content_type="application/json",
                        headers={"Location": PREFIX + warm.id, REQUEST_ID_HEADER: warm.id,
                                 "Cache-Control": "no-store"})


async def get_warm(request: web.Request) -> web.Response:
    return _answer(request, cancel=False)


async def delete_warm(request: web.Request) -> web.Response:
    return _answer(request, cancel=True)


def _answer(request: web.Request, *, cancel: bool) -> web.Response:
    state, warmer = request.app[STATE], request.app[WARMER]
    verdict = _verdict(request, state)
    if isinstance(verdict, Refuse):
        return error_response(verdict.error())
    warm_id = request.match_info["warm_id"]
    warm = warmer.queue.warmups.get(warm_id)
    caller = verdict.client
    if warm is None or (caller not in (None, ADMIN_CLIENT) and warm.client != caller):
        return error_response(NoSuchWarmUp(
            f"no warm-up {clean_text(warm_id)!r}: it never was, or it ended more than warm.expire_s "
            "ago (ids are what POST /slotwise/warm/... answered)"))
    if cancel:
        warmer.cancel(warm_id)
    private = warmer.isolated() and caller != ADMIN_CLIENT
    body = orjson.dumps(warm_view(warm, warmer.knobs(), warmer.now(), private=private))
    return web.Response(body=body, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _verdict(request: web.Request, state: ProxyState) -> Allow | Refuse:
    config = state.config
    return decide(config.access, config.upstream.api_key, request.method, request.raw_path,
                  request.headers)


def _flight(request: web.Request, state: ProxyState, verdict: Allow | Refuse) -> Flight:
    registry = state.registry
    warm_id = state.ids.issue(f"warm-{uuid.uuid4().hex[:16]}",
                              lambda taken: registry.get(taken) is not None)
    client = verdict.client if isinstance(verdict, Allow) and verdict.client else None
    return warm_flight(warm_id, request.path, now=state.clock(), wall=time.time(),
                       config_gen=state.config_gen,
                       client=client or clean_text(request.headers.get(CLIENT_HEADER)),
                       purpose=clean_text(request.headers.get(PURPOSE_HEADER)),
                       node=node_name(state.config))


def install_routes(app: web.Application) -> None:
    app.router.add_post(PREFIX + "{endpoint:.+}", post_warm)
    app.router.add_get(PREFIX + "{warm_id}", get_warm)
    app.router.add_delete(PREFIX + "{warm_id}", delete_warm)
