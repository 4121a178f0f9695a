"""The warm feature, around the `Warmer` the scheduler built (proxy/scheduler.py, installed
before it, whose one loop ticks it): the warm endpoints and the warm-ups' figures in /metrics. At
shutdown every warm-up still pending or running ends, cancelled, with its record.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from aiohttp import web
from prometheus_client.core import Metric

from proxy.ops.metrics import METRICS
from proxy.state import STATE, ProxyState
from proxy.warm.routes import WARMER, install_routes
from proxy.warm.views import status_view, warm_metrics
from proxy.warm.warmer import Warmer


class WarmCollector:
    """The warm-ups in /metrics, read at scrape time."""

    def __init__(self, warmer: Warmer) -> None:
        self.warmer = warmer

    def collect(self) -> Iterable[Metric]:
        w = self.warmer
        return warm_metrics(w.queue, w.ended, w.computed_tokens, w.warmed_tokens)


def warm_status(warmer: Warmer, state: ProxyState) -> dict[str, object]:
    """The status page's `warm` section."""
    return status_view(warmer.queue, warmer.knobs(), state.config.warm.enabled, warmer.ended,
                       warmer.now())


def install(app: web.Application) -> None:
    app.cleanup_ctx.append(_lifecycle)
    install_routes(app)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    warmer, state = app[WARMER], app[STATE]
    state.status_sections["warm"] = lambda: warm_status(warmer, state)
    if METRICS in app:
        app[METRICS].registry.register(WarmCollector(warmer))
    try:
        yield
    finally:
        await warmer.close()
