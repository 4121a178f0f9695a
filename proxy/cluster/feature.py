"""The cluster feature: GET /health, GET /get_load, the render endpoints, the `X-Slotwise-Node`
header on every response, and their figures in /metrics (when the metrics feature is installed).

Installed after the scheduler (`proxy/scheduler.py`), whose estimator the render endpoints use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import orjson
from aiohttp import web
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.cluster.health import health
from proxy.cluster.load import NodeLoad, node_load, sglang_body, vllm_body
from proxy.cluster.render import RENDER_PATHS, Renderer
from proxy.config import LOAD_FORMATS
from proxy.estimate.ids_cache import PromptIdsCache
from proxy.ops.metrics import METRICS
from proxy.prefill.estimator import ESTIMATOR
from proxy.record.node import NODE_HEADER, node_name
from proxy.request.access import Refuse, decide_load
from proxy.request.errors import BadRequest, error_response
from proxy.state import STATE, ProxyState

RENDERER = web.AppKey("slotwise_renderer", Renderer)
RENDER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


def current_load(state: ProxyState) -> NodeLoad:
    return node_load(state.registry, state.config.prefill.cold_tokens)


async def get_load(request: web.Request) -> web.Response:
    state = request.app[STATE]
    verdict = decide_load(state.config, request.path, request.headers)
    if isinstance(verdict, Refuse):
        return error_response(verdict.error())
    fmt = request.query.get("format", state.config.cluster.load_format)
    if fmt not in LOAD_FORMATS:
        return error_response(BadRequest(
            f"GET /get_load: unknown format {fmt!r} (valid: {', '.join(LOAD_FORMATS)})"))
    load = current_load(state)
    body = vllm_body(load, node_name(state.config)) if fmt == "vllm" else sglang_body(load)
    return web.Response(body=orjson.dumps(body), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def add_node_header(request: web.Request, response: web.StreamResponse) -> None:
    """Every response names the node that answered (before its headers are sent)."""
    if STATE in request.app:
        response.headers[NODE_HEADER] = node_name(request.app[STATE].config)


class ClusterCollector:
    """The load figure and the prompt ids cache, read at scrape time."""

    def __init__(self, state: ProxyState, cache: PromptIdsCache) -> None:
        self.state = state
        self.cache = cache

    def collect(self) -> Iterable[Metric]:
        load = current_load(self.state)
        yield GaugeMetricFamily("slotwise_node_load", "The load figure GET /get_load answers",
                                value=load.load)
        yield GaugeMetricFamily("slotwise_node_requests_waiting",
                                "Generating requests waiting: held by the prefill policy or queued "
                                "in llama-server (an endpoint picker's queued-requests metric)",
                                value=load.waiting)
        yield GaugeMetricFamily("slotwise_node_requests_running",
                                "Generating requests in a slot (prefilling, decoding)",
                                value=load.running)
        yield GaugeMetricFamily("slotwise_cold_tokens_pending",
                                "Prompt tokens estimated still to compute for the requests in flight",
                                value=load.cold_tokens)
        lookups = CounterMetricFamily("slotwise_prompt_ids_cache_lookups",
                                      "Lookups of a body's prompt ids among recent bodies",
                                      labels=["result"])
        lookups.add_metric(["hit"], self.cache.counts.hits)
        lookups.add_metric(["miss"], self.cache.counts.misses)
        yield lookups
        yield GaugeMetricFamily("slotwise_prompt_ids_cache_tokens",
                                "Prompt ids the cache of recent bodies holds (4 bytes each)",
                                value=self.cache.tokens)


def install(app: web.Application) -> None:
    async def cluster_ctx(app: web.Application) -> AsyncIterator[None]:
        state, estimator = app[STATE], app[ESTIMATOR]
        seconds: Histogram | None = None
        if METRICS in app:
            registry = app[METRICS].registry
            seconds = Histogram("slotwise_render_seconds",
                                "Time to answer a render request (the router waits for it)",
                                ["result"], buckets=RENDER_BUCKETS, registry=registry)
            registry.register(ClusterCollector(state, estimator.ids_cache))

        def observe(elapsed: float, ok: bool) -> None:
            if seconds is not None:
                seconds.labels("ok" if ok else "error").observe(elapsed)

        app[RENDERER] = Renderer(estimator, observe)
        yield

    async def render(request: web.Request) -> web.Response:
        return await request.app[RENDERER].handle(request)

    app.cleanup_ctx.append(cluster_ctx)
    app.on_response_prepare.append(add_node_header)
    app.router.add_get("/health", health)
    app.router.add_get("/get_load", get_load)
    for path in RENDER_PATHS:
        app.router.add_post(path, render)
