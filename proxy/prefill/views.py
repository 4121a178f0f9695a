"""What the prefill policy shows the operator: its section of the status page and its gauges in
/metrics (the fitted batch cost, how well it fits, the strategy of the cold prompt being fed), both
read from the policy's snapshot at request time and pushed to the ops pages by the feature.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from proxy.prefill.snapshot import PolicySnapshot
from proxy.prefill.strategy import Strategy


def prefill_view(snap: PolicySnapshot | None) -> dict[str, Any] | None:
    """The prefill policy: its mode, the fitted batch cost, and how the active cold prompt goes on."""
    if snap is None:
        return None
    choice = snap.choice
    return {
        "mode": snap.mode, "waiting": len(snap.waiting), "cost": snap.cost.summary(),
        "choice": None if choice is None else {
            "strategy": choice.strategy.value, "piece_tokens": choice.piece_tokens,
            "predicted_piece_ms": round(choice.predicted_piece_ms, 1),
            "predicted_streams_share": round(choice.predicted_streams_share, 3),
            "predicted_cold_factor": round(choice.predicted_cold_factor, 2),
            "reason": choice.reason},
    }


COST_PARTS = (("fixed", "fixed_ms"), ("per_kctx", "per_kctx_ms"), ("per_token", "per_token_ms"),
              ("per_token_per_kctx", "per_token_per_kctx_ms"), ("per_decoder", "per_decoder_ms"),
              ("per_token_per_kcells", "per_token_per_kcells_ms"), ("per_kcells", "per_kcells_ms"))


def prefill_gauges(snap: PolicySnapshot | None) -> Iterable[Metric]:
    """The fitted batch cost, how well it fits, and how the active cold prompt goes on."""
    if snap is None:
        return
    cost = GaugeMetricFamily("slotwise_prefill_batch_cost_ms",
                             "The fitted batch-cost model: ms per batch (fixed), per batch per 1k tokens "
                             "of context, per prompt token, per token per 1k tokens of context, per "
                             "decoding slot, per token and per batch per 1k cells other requests "
                             "hold", labels=["part"])
    for label, attr in COST_PARTS:
        cost.add_metric([label], getattr(snap.cost.cost, attr))
    yield cost
    if snap.cost.median_error is not None:
        yield GaugeMetricFamily("slotwise_prefill_batch_cost_error",
                                "Median relative error of the batch-cost model's recent predictions",
                                value=snap.cost.median_error)
    chosen = GaugeMetricFamily("slotwise_prefill_strategy",
                               "How the cold prompt being fed goes on now (1 for the strategy in use)",
                               labels=["strategy"])
    for strategy in Strategy:
        chosen.add_metric([strategy.value], 1.0 if snap.choice and snap.choice.strategy is strategy
                          else 0.0)
    yield chosen


class PrefillCollector:
    """The prefill gauges in /metrics, read at scrape time."""

    def __init__(self, snapshot: Callable[[], PolicySnapshot | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        return prefill_gauges(self.snapshot())
