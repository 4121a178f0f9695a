"""The timing record: one JSON object per request, assembled when it ends (fields: README.md).

Pure: it reads a finished `Flight` and what the handler learned, and returns plain data. It never
sees prompt or generated text.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proxy.inflight import Flight


@dataclass
class Outcome:
    """What the handler learned about a request besides its clock."""

    method: str
    endpoint: str
    wall_start: float  # time.time() at arrival
    config_gen: int
    outcome: str = "done"
    status: int | None = None
    error: str | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    timings: dict[str, Any] | None = None
    lora_in: Any = None
    lora_rewritten: bool = False
    progress_added: bool = False
    prefill_plan: str = "none"
    held_ms: float = 0.0
    pieces: int = 0
    est_prompt_tokens: int | None = None
    policy_note: str | None = None


def build_record(flight: Flight, out: Outcome) -> dict[str, Any]:
    timer = flight.timer
    figures = timer.figures()
    return {
        "id": flight.id,
        "start": datetime.fromtimestamp(out.wall_start, UTC).isoformat(timespec="milliseconds"),
        "method": out.method,
        "endpoint": out.endpoint,
        "kind": str(flight.kind),
        "status": out.status,
        "stream": flight.stream,
        "outcome": out.outcome,
        "error": out.error,
        "client": flight.client,
        "purpose": flight.purpose,
        "config_gen": out.config_gen,
        "bytes_in": out.bytes_in,
        "bytes_out": out.bytes_out,
        **figures,
        "prefill_wait_ms": prefill_wait_ms(flight, figures, out.timings),
        "prompt_tokens": flight.prompt_tokens,
        "computed_tokens": flight.new_tokens,
        "fed_tokens": flight.fed_tokens,
        "timings": out.timings,
        "lora_in": out.lora_in,
        "lora_out": flight.lora_out,
        "lora_rewritten": out.lora_rewritten,
        "progress_added": out.progress_added,
        "inflight_at_start": flight.inflight_at_start,
        "overlaps": overlaps(flight),
        "prefill_plan": out.prefill_plan,
        "held_ms": out.held_ms,
        "pieces": out.pieces,
        "est_prompt_tokens": out.est_prompt_tokens,
        "est_new_tokens": flight.est_new_tokens,
        "policy_note": out.policy_note,
    }


def prefill_wait_ms(flight: Flight, figures: dict[str, Any],
                    timings: dict[str, Any] | None) -> float | None:
    """Arrival → prefill start: measured for streams, derived from totals otherwise."""
    timer = flight.timer
    if timer.prefill_started is not None:
        return timer.ms(timer.arrived, timer.prefill_started)
    if flight.stream or not timings or timer.headers is None:
        return None
    prompt_ms, predicted_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
    if not isinstance(prompt_ms, int | float) or not isinstance(predicted_ms, int | float):
        return None
    waited = (timer.headers - timer.arrived) * 1000.0 - prompt_ms - predicted_ms
    return round(max(waited, 0.0), 1)


def overlaps(flight: Flight) -> list[dict[str, Any]]:
    """Every other request whose prefill overlapped this one's life, with this one's decode in it."""
    timer = flight.timer
    end = timer.ended if timer.ended is not None else timer.arrived
    result = []
    for peer in flight.prefill_peers:
        if peer.prefill_start is None:
            continue
        lo = max(peer.prefill_start, timer.arrived)
        hi = min(peer.prefill_end if peer.prefill_end is not None else end, end)
        if hi <= lo:
            continue
        events, decode_s = _decode_inside(timer.tokens, lo, hi)
        result.append({
            "id": peer.id,
            "new_tokens": _computed(peer),
            "from_ms": round((lo - timer.arrived) * 1000.0, 1),
            "to_ms": round((hi - timer.arrived) * 1000.0, 1),
            "decode_events": events,
            "decode_ms": round(decode_s * 1000.0, 1),
        })
    return result


def _computed(flight: Flight) -> int | None:
    """All the prompt tokens the server computed for a request: its own and its pieces'."""
    if flight.new_tokens is None:
        return flight.fed_tokens or None
    return flight.new_tokens + flight.fed_tokens


def _decode_inside(tokens: list[float], lo: float, hi: float) -> tuple[int, float]:
    """Token events in (lo, hi] and how long this request was decoding within [lo, hi]."""
    if len(tokens) < 2:
        return 0, 0.0
    events = bisect.bisect_right(tokens, hi) - bisect.bisect_right(tokens, lo)
    span = min(hi, tokens[-1]) - max(lo, tokens[0])
    return events, max(span, 0.0)
