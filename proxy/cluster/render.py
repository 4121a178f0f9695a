"""`POST /v1/chat/completions/render`, `/v1/completions/render`, `/v1/responses/render`: the prompt's
token ids of a request body, exactly as llama-server will see them, as `{"token_ids": [...]}`.

vllm-router's `cache_aware` policy asks every node for them before it routes a request, and matches
the ids against what it sent each node before; vLLM serves the same endpoints. The ids come from the
estimator slotwise already has (the tokenizer in use, in process or llama-server's /apply-template
and /tokenize) and its cache of recent bodies, so the node that then gets the request itself does
not tokenize it again. The router waits for these answers (about a second at most) before it
routes, so every millisecond here is one of the client's: the time each answer took is in
`/metrics` (`slotwise_render_seconds`). Any client that may call the model endpoints may render, so
a render is bounded as a forwarded request is: its body's size and deadline, and the prompt one
slot can hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson
from aiohttp import web

from proxy.estimate import EstimateError
from proxy.prefill.estimator import Estimator
from proxy.request.access import Refuse, decide
from proxy.request.errors import (
    BadRequest,
    NotReady,
    PayloadTooLarge,
    ProxyError,
    error_response,
)
from proxy.request.intake import BodyReader
from proxy.state import STATE
from proxy.upstream import UpstreamCallError

RENDER_PATHS = {
    "/v1/chat/completions/render": "chat",
    "/v1/completions/render": "completions",
    "/v1/responses/render": "responses",
}
"""The render endpoints, and the kind of body each takes."""


def render_error(exc: EstimateError) -> ProxyError:
    """What the caller is told when a body cannot be rendered. Its own fault (400): a body slotwise
    cannot tokenize exactly, a prompt longer than a slot, a body llama-server refuses or fails on
    (its 500s too: a body it cannot template). Not ready (503) only when llama-server did not answer,
    or answered 503 (loading its model), so a router passes the node over for that and nothing
    else. The text names the call's path, never the upstream's address."""
    cause = exc.__cause__
    if isinstance(cause, UpstreamCallError):
        if cause.status is None or cause.status == 503:
            return NotReady(f"cannot render now, llama-server did not answer: {cause.public}")
        return BadRequest(f"cannot render this body: {cause.public}")
    return BadRequest(f"cannot render this body: {exc}")


async def answer_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Send the answer, then close the connection: the rest of a body that broke its limits is
    not read (aiohttp would go on reading a dripping body for its lingering time, 10 s)."""
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()  # the answer's bytes are flushed before the socket closes
    return response


class Renderer:
    """Serves the render endpoints with the running proxy's estimator; `observe(seconds, ok)` is
    told how long each answer took (the metrics). The body is read as a forwarded request's is
    (`BodyReader`: listen.max_body_mb, listen.body_timeout_s); a prompt longer than one slot of
    the server is refused (400) before its ids are decoded."""

    def __init__(self, estimator: Estimator, observe: Callable[[float, bool], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.estimator = estimator
        self.observe = observe
        self.clock = clock

    async def handle(self, request: web.Request) -> web.Response:
        state = request.app[STATE]
        config = state.config
        verdict = decide(config.access, config.upstream.api_key, request.method, request.raw_path,
                         request.headers)
        if isinstance(verdict, Refuse):
            return error_response(verdict.error())
        reader = BodyReader(request, state.max_body_bytes, config.listen.body_timeout_s)
        started = self.clock()
        ok = False
        try:
            body = reader.decode(await reader.read())
            ids = await self.estimator.prompt_ids(config.prefill, RENDER_PATHS[request.path], body)
            ok = True
        except EstimateError as exc:
            return error_response(render_error(exc))
        except ProxyError as exc:
            if reader.too_slow is not None or isinstance(exc, PayloadTooLarge):
                return await answer_and_close(request, error_response(exc))
            return error_response(exc)
        finally:
            self.observe(self.clock() - started, ok)
        return web.Response(body=orjson.dumps({"token_ids": ids}), content_type="application/json")
