"""The warm endpoints: `POST /slotwise/warm/<endpoint>` queues a warm-up and answers 202 at once;
`GET` and `DELETE /slotwise/warm/<id>` report on one and cancel it. They translate HTTP to the
warmer's values and back; a POST that is refused gets its record here, an accepted one when it ends.

Who may call them: whoever may call the model endpoints (`[access]`, `access.decide`). With client
keys, a warm-up is seen and cancelled only by its own client (or the admin key).
"""

from __future__ import annotations

import time
import uuid

import orjson
from aiohttp import web

from proxy.cluster.render import render_error
from proxy.config import ADMIN_CLIENT
from proxy.estimate import EstimateError
from proxy.record.clientstrings import clean_text
from proxy.record.flight import Flight
from proxy.record.node import node_name
from proxy.request.access import Allow, Refuse, decide
from proxy.request.endpoints import classify
from proxy.request.errors import (
    NoSuchWarmUp,
    ProxyError,
    ShuttingDown,
    TooManyWarmUps,
    WarmOff,
    error_response,
)
from proxy.request.headers import CLIENT_HEADER, PURPOSE_HEADER, REQUEST_ID_HEADER
from proxy.request.intake import Intake
from proxy.request.trip import failed, guaranteed
from proxy.state import STATE, ProxyState
from proxy.warm.prefix import WARM_KINDS
from proxy.warm.record import warm_flight, warm_record
from proxy.warm.values import WarmRefused, WarmUp
from proxy.warm.views import warm_view
from proxy.warm.warmer import Warmer

PREFIX = "/slotwise/warm/"
WARMER = web.AppKey("slotwise_warmer", Warmer)
VALID = "/v1/chat/completions, /v1/completions, /completion, /v1/messages, /v1/responses"


def warm_kind(endpoint: str) -> str:
    kind = str(classify("POST", "/" + endpoint))
    if kind not in WARM_KINDS:
        raise NoSuchWarmUp(f"{PREFIX}{endpoint}: cannot warm /{endpoint} (valid: {PREFIX} followed by "
                           f"one of {VALID} and their aliases)")
    return kind


async def post_warm(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return await guaranteed(WarmPost(request, state, request.app[WARMER]), state)


class WarmPost:
    """One POST's trip (`proxy/request/trip.py`): refused, it writes its record as it ends;
    accepted, the flight is the warm-up's, whose record the warmer writes when it ends."""

    def __init__(self, request: web.Request, state: ProxyState, warmer: Warmer) -> None:
        self.request, self.state, self.warmer = request, state, warmer
        self.verdict = _verdict(request, state)
        self.flight = _flight(request, state, self.verdict)
        self.response: web.StreamResponse | None = None
        self.handed_over = False

    async def run(self) -> web.StreamResponse:
        state, flight = self.state, self.flight
        if isinstance(self.verdict, Refuse):
            raise self.verdict.error()
        if not state.config.warm.enabled:
            raise WarmOff("warm-ups are off (warm.enabled = false in slotwise's config)")
        kind = warm_kind(self.request.match_info["endpoint"])
        intake = Intake(self.request, flight, state.max_body_bytes, state.config.listen.body_timeout_s)
        model = await intake.model_body(state.forced_lora())
        try:
            warm = await self.warmer.submit(flight, kind, model.rewritten.body,
                                            model.rewritten.lora_out)
        except EstimateError as exc:
            raise render_error(exc) from exc
        except WarmRefused as exc:
            raise TooManyWarmUps(str(exc)) from exc
        self.handed_over = True
        return _accepted(flight, warm, self.warmer)

    def fail(self, error: ProxyError) -> web.StreamResponse:
        return failed(self.flight, error)

    def can_answer(self) -> bool:
        return True  # its answer is one body, sent after `run` returns

    async def cut(self, error: ShuttingDown) -> web.StreamResponse:
        return self.fail(error)

    def finish(self) -> None:
        if not self.handed_over:  # refused: its one record now (an accepted one's when it ends)
            self.flight.timer.on_end(self.state.clock())
            self.state.emit(warm_record(self.flight, None))


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
