"""The warm feature: the warm endpoints, a `Warmer` over the prefill feature's estimator and gate
(installed after it), the gate's `warm` hook, the warm-ups' figures in /metrics, and the warmer's
loop. At shutdown every warm-up still pending or running ends, cancelled, with its record.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from aiohttp import web
from prometheus_client.core import Metric

from proxy.ops.background import background
from proxy.ops.metrics import METRICS
from proxy.prefill.feature import ESTIMATOR, GATE
from proxy.prefill.feeder import PieceFeeder
from proxy.state import STATE
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


def warm_status(app: web.Application) -> dict[str, object] | None:
    """The status page's `warm` section (None without the feature)."""
    if WARMER not in app:
        return None
    warmer = app[WARMER]
    return status_view(warmer.queue, warmer.knobs(), app[STATE].config.warm.enabled, warmer.ended,
                       warmer.now())


def install(app: web.Application) -> None:
    app.cleanup_ctx.append(_lifecycle)
    install_routes(app)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state, gate = app[STATE], app[GATE]

    def teach(prompt_n: int, cache_n: int, prompt_ms: float) -> None:
        """A warm piece is a batch like a cold prompt's: the batch cost learns from it."""
        gate.policy.observe_piece(prompt_n, cache_n, prompt_ms)

    warmer = Warmer(state, gate.snapshot, app[ESTIMATOR], PieceFeeder(state.upstream), teach)
    app[WARMER] = warmer
    gate.warm = warmer.claim
    state.registry.subscribe(warmer.on_phase)
    if METRICS in app:
        app[METRICS].registry.register(WarmCollector(warmer))
    try:
        async with background(warmer.run(), "slotwise-warm"):
            yield
    finally:
        await warmer.close()
