"""`POST /v1/chat/completions/render`, `/v1/completions/render`, `/v1/responses/render`: the prompt's
token ids of a request body, exactly as llama-server will see them, as `{"token_ids": [...]}`.

vllm-router's `cache_aware` policy asks every node for them before it routes a request, and matches
the ids against what it sent each node before; vLLM serves the same endpoints. The ids come from the
estimator slotwise already has (the tokenizer in use, in process or llama-server's /apply-template
and /tokenize) and its cache of recent bodies, so the node that then gets the request itself does
not tokenize it again. The router waits for these answers (about a second at most) before it
routes, so every millisecond here is one of the client's: the time each answer took is in
`/metrics` (`slotwise_render_seconds`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from proxy.estimate import EstimateError, NotEstimable
from proxy.prefill.estimator import Estimator
from proxy.request.access import Refuse, decide
from proxy.request.errors import PROXY_ERROR_HEADER, BadRequest, ProxyError
from proxy.state import STATE
from proxy.upstream import UpstreamCallError

RENDER_PATHS = {
    "/v1/chat/completions/render": "chat",
    "/v1/completions/render": "completions",
    "/v1/responses/render": "responses",
}
"""The render endpoints, and the kind of body each takes."""


class NotReady(ProxyError):
    """The upstream cannot answer now (down, restarting, loading its model)."""

    status = 503
    type = "slotwise_not_ready"
    outcome = "upstream_error"


def error_response(error: ProxyError) -> web.Response:
    return web.Response(status=error.status, body=error.body_bytes(), content_type="application/json",
                        headers={PROXY_ERROR_HEADER: error.type, **error.headers()})


def render_error(exc: EstimateError) -> ProxyError:
    """A body slotwise cannot tokenize exactly is the caller's problem (400); an upstream that does
    not answer, or answers 5xx, makes this node not ready (503), so a router passes it over."""
    if isinstance(exc, NotEstimable):
        return BadRequest(f"cannot render this body: {exc}")
    cause = exc.__cause__
    if isinstance(cause, UpstreamCallError) and (cause.status is None or cause.status >= 500):
        return NotReady(f"cannot render now: {exc}")
    return BadRequest(f"cannot render this body: {exc}")


def decode_body(raw: bytes, path: str) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body of POST {path} is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise BadRequest(f"the body of POST {path} must be a JSON object (the request to render), "
                         f"got a JSON {type(body).__name__}")
    return body


class Renderer:
    """Serves the render endpoints with the running proxy's estimator; `observe(seconds, ok)` is
    told how long each answer took (the metrics)."""

    def __init__(self, estimator: Estimator, observe: Callable[[float, bool], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.estimator = estimator
        self.observe = observe
        self.clock = clock

    async def handle(self, request: web.Request) -> web.Response:
        config = request.app[STATE].config
        verdict = decide(config.access, config.upstream.api_key, request.method, request.raw_path,
                         request.headers)
        if isinstance(verdict, Refuse):
            return error_response(verdict.error())
        started = self.clock()
        ok = False
        try:
            body = decode_body(await request.read(), request.path)
            ids = await self.estimator.prompt_ids(config.prefill, RENDER_PATHS[request.path], body)
            ok = True
        except EstimateError as exc:
            return error_response(render_error(exc))
        except ProxyError as exc:
            return error_response(exc)
        finally:
            self.observe(self.clock() - started, ok)
        return web.Response(body=orjson.dumps({"token_ids": ids}), content_type="application/json")
