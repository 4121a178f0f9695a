"""What the warm endpoints, the status page and /metrics show of the warm-ups. Pure: queue values
in, plain data out (no token ids, no text)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.record.outcome import Outcome
from proxy.warm.values import WarmKnobs, WarmUp

PRIVATE_FIELDS = ("cached", "est_tokens", "done_tokens", "computed_tokens", "pieces", "reason")
"""What a warm-up's answer leaves out for a client when caches are each client's own: how much of
its prompt the server held already would tell it what another client's prompts are."""


def warm_view(warm: WarmUp, knobs: WarmKnobs, now: float, *, private: bool = False) -> dict[str, Any]:
    """One warm-up, as `GET /slotwise/warm/<id>` answers and the status page lists it; `private`:
    for a client, when caches are each client's own (PRIVATE_FIELDS are left out)."""
    view: dict[str, Any] = {
        "id": warm.id, "state": warm.state, "client": warm.client,
        "prompt_tokens": len(warm.ids), "cached": warm.cached, "est_tokens": warm.to_compute,
        "capped": warm.capped, "done_tokens": warm.done_upto, "computed_tokens": warm.computed,
        "pieces": warm.pieces, "age_s": round(now - warm.submitted, 2),
    }
    if warm.outcome is None:
        view["expires_in_s"] = round(max(0.0, warm.submitted + knobs.expire_s - now), 1)
    else:
        view.update(outcome=str(warm.outcome), reason=warm.reason)
    if private:
        for name in PRIVATE_FIELDS:
            view.pop(name, None)
    return view


def status_view(warmups: Iterable[WarmUp], knobs: WarmKnobs, enabled: bool, ended: Mapping[str, int],
                now: float) -> dict[str, Any]:
    """The status page's `warm` section: pending and running warm-ups, and how many ended how."""
    listed = [w for w in warmups if w.outcome is None]
    return {
        "enabled": enabled,
        "pending": [warm_view(w, knobs, now) for w in listed if w.state == "pending"],
        "running": [warm_view(w, knobs, now) for w in listed if w.state == "running"],
        "ended": {str(o): ended.get(str(o), 0) for o in Outcome},
    }


def warm_metrics(warmups: Iterable[WarmUp], ended: Mapping[str, int], computed: int,
                 warmed: int) -> Iterable[Metric]:
    """Read at scrape time."""
    states = {"pending": 0, "running": 0}
    for warm in warmups:
        if warm.state in states:
            states[warm.state] += 1
    now = GaugeMetricFamily("slotwise_warmups", "Warm-ups pending or running now", labels=["state"])
    for state, count in states.items():
        now.add_metric([state], count)
    yield now
    done = CounterMetricFamily("slotwise_warmups_ended", "Warm-ups ended, by outcome",
                               labels=["outcome"])
    for outcome, count in sorted(ended.items()):
        done.add_metric([outcome], count)
    yield done
    yield CounterMetricFamily("slotwise_warm_computed_tokens",
                              "Prompt tokens warm-ups computed into llama-server's cache",
                              value=computed)
    yield CounterMetricFamily("slotwise_warmed_tokens",
                              "Prompt tokens of real requests that warm-ups had computed ahead of them",
                              value=warmed)
