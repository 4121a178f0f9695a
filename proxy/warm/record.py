"""The one timing record of a warm-up (kind `warm`): the facts of its POST (a `Flight` the warmer
keeps for it: times, client, status) and how the warm-up went, from its queue's `WarmUp`, put
together without writing on either. Pure.

Its fields say: `outcome` done, cancelled, superseded, expired or failed (or why the POST was refused);
`prompt_tokens` the prefix it warms, `est_new_tokens` what was to compute of it, `fed_tokens` the
tokens computed, `pieces`, `held_ms` the time it waited before its first piece, `prefill_ms` first
piece to last, `total_ms` the time from the POST to its end, `policy_note` why it ended
(docs/warm.md).
"""

from __future__ import annotations

from dataclasses import replace

from proxy.record.clientstrings import safe_text
from proxy.record.flight import Flight, PrefillPlan
from proxy.record.inflight import Registry
from proxy.record.kind import Kind
from proxy.record.outcome import Outcome
from proxy.record.schema import MAX_ERROR_CHARS, Record, build_record
from proxy.record.timing import RequestTimer
from proxy.warm.values import WarmUp


def warm_flight(warm_id: str, endpoint: str, *, now: float, wall: float, config_gen: int,
                client: str | None, purpose: str | None, node: str | None) -> Flight:
    """The facts of a warm-up from its POST on. It is never a request in flight (the registry only
    hears of its pieces' prefill)."""
    return Flight(id=warm_id, kind=Kind.WARM, method="POST", endpoint=endpoint, wall_start=wall,
                  config_gen=config_gen, timer=RequestTimer(arrived=now), client=client,
                  purpose=purpose, node=node)


def ended_warm_record(flight: Flight, warm: WarmUp, registry: Registry, now: float) -> Record:
    """A warm-up that ended at `now`: its flight closed (its prefill, if a piece ran, ended with
    the last piece and leaves the registry) and its record (the warmer's, the what-if's)."""
    flight.timer.on_end(now)
    flight.status = 202
    if flight.prefill_start is not None:
        flight.prefill_end = flight.timer.prefill_done or now
        registry.finish(flight, now)
    return warm_record(flight, warm)


def warm_record(flight: Flight, warm: WarmUp | None) -> Record:
    """The record, once the warm-up ended (or its POST was refused: `warm` None, the flight's
    status and outcome already say why)."""
    record = build_record(flight)
    if warm is None:
        return record
    first = warm.started if warm.started is not None else warm.ended
    outcome = warm.outcome or Outcome.CANCELLED
    note = warm.reason + ("; cut at warm.max_tokens" if warm.capped else "")
    return replace(
        record, outcome=outcome, error=safe_text(warm.reason, MAX_ERROR_CHARS)
        if outcome is Outcome.FAILED else None,
        prompt_tokens=len(warm.ids), est_prompt_tokens=len(warm.ids),
        est_new_tokens=warm.to_compute, fed_tokens=warm.computed, pieces=warm.pieces,
        prefill_plan=str(PrefillPlan.CHUNKED if warm.pieces else PrefillPlan.NONE),
        held_ms=record.held_ms if first is None else round((first - warm.submitted) * 1000.0, 1),
        policy_note=safe_text(note, MAX_ERROR_CHARS))
