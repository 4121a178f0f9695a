"""`GET /health`: is this node ready for requests? A router's health check asks it every second or so.

While llama-server answers its own /health within `cluster.health_timeout_s`, its answer is passed on
as it is (200 `{"status":"ok"}`, or 503 while it loads its model), as it would be forwarded. When it
does not answer, slotwise says "not ready" itself: 503 with what is wrong (never the upstream's
address: anyone may ask), at once, where a forwarded request would get slotwise's 502 only after
the connect timeout; and so it does while slotwise is stopping (SIGTERM: the streams in flight
finish, new requests should go elsewhere). The check is slotwise's own call, not a forwarded
request: it leaves no timing record (a router's checks every second would flood the log).
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from proxy.state import STATE, ProxyState
from proxy.upstream import send


@dataclass(frozen=True)
class Answer:
    """What /health answers: the upstream's own answer, or slotwise's "not ready"."""

    status: int
    body: bytes
    content_type: str


def not_ready(reason: str) -> Answer:
    body = {"status": "unavailable",
            "error": {"code": 503, "type": "unavailable_error", "message": f"slotwise: not ready: {reason}"}}
    return Answer(503, orjson.dumps(body), "application/json")


async def ask_upstream(state: ProxyState) -> Answer:
    """llama-server's own /health, or "not ready" when it does not answer in time."""
    timeout_s = state.config.cluster.health_timeout_s
    url = state.upstream_url.rstrip("/") + "/health"
    headers = {**state.own_headers(), "Accept-Encoding": "identity"}
    try:
        async with await send(state.session, "GET", url, headers=headers,
                              timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            body = await response.read()
            return Answer(response.status, body, response.headers.get("Content-Type", ""))
    except TimeoutError:
        return not_ready(f"llama-server did not answer within {timeout_s:g} s")
    except aiohttp.ClientError as exc:  # its text names the upstream's address: not for clients
        return not_ready(f"llama-server does not answer ({type(exc).__name__})")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.stopping:
        answer = not_ready("slotwise is stopping (the requests in flight are finishing)")
    else:
        answer = await ask_upstream(state)
    response = web.Response(status=answer.status, body=answer.body,
                            headers={"Cache-Control": "no-store"})
    if answer.content_type:
        response.headers["Content-Type"] = answer.content_type
    return response
