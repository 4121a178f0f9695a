"""The one timing record of a warm-up (kind `warm`): made like every request's, from a `Flight` the
warmer keeps for it, with how the warm-up ended. Pure.

Its fields say: `outcome` done, cancelled, superseded, expired or failed (or why the POST was refused);
`fed_tokens` the tokens computed, `pieces`, `total_ms` the time from the POST to its end, `held_ms`
the time it waited before its first piece, `prefill_ms` first piece to last, `est_prompt_tokens` the
prefix, `est_new_tokens` what was to compute, `policy_note` why it ended (docs/warm.md).
"""

from __future__ import annotations

from dataclasses import replace

from proxy.record.flight import Flight, PrefillPlan
from proxy.record.kind import Kind
from proxy.record.schema import Record, build_record
from proxy.record.timing import RequestTimer
from proxy.warm.values import Outcome, WarmUp

WARM_KIND = "warm"


def warm_flight(warm_id: str, endpoint: str, *, now: float, wall: float, config_gen: int,
                client: str | None, purpose: str | None, node: str | None) -> Flight:
    """The facts of a warm-up from its POST on. Its kind is `other` until the record says `warm`:
    it is never a request in flight (the registry only hears of its pieces' prefill)."""
    return Flight(id=warm_id, kind=Kind.OTHER, method="POST", endpoint=endpoint, wall_start=wall,
                  config_gen=config_gen, timer=RequestTimer(arrived=now), client=client,
                  purpose=purpose, node=node)


def warm_record(flight: Flight, warm: WarmUp | None) -> Record:
    """The record, once the warm-up ended (or its POST was refused: `warm` None, the flight's
    status and outcome already say why)."""
    if warm is not None:
        facts = flight.prefill
        facts.plan = PrefillPlan.CHUNKED if warm.pieces else PrefillPlan.NONE
        facts.pieces, facts.fed_tokens = warm.pieces, warm.computed
        facts.est_prompt_tokens, facts.est_new_tokens = len(warm.ids), warm.to_compute
        first = warm.started if warm.started is not None else warm.ended
        if first is not None:
            facts.held_ms = round((first - warm.submitted) * 1000.0, 1)
        facts.note = warm.reason + ("; cut at warm.max_tokens" if warm.capped else "")
        flight.prompt_tokens = len(warm.ids)
        flight.outcome = str(warm.outcome or Outcome.CANCELLED)
        flight.error = warm.reason if warm.outcome is Outcome.FAILED else None
    return replace(build_record(flight), kind=WARM_KIND)
