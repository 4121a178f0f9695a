"""What the day's client saw, turned into the day's own figures (pure): each returning user's and
each post-summary turn's time to first token (and how long it found every slot taken), every
request's time to first token by its purpose (chat turns apart from background jobs), each cold
request's first token against its own time alone, and everyone's longest gap between tokens (and
the prefills that ran during it). The calls themselves, and the direct paths' timing records made
from them, are `calls.py`'s.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.bench.calls import Call
from proxy.bench.day import Act
from proxy.report.records import fed_tokens

# -- the day's own figures -----------------------------------------------------------------------

def day_figures(calls: Sequence[Call], proxy_records: Sequence[Mapping[str, Any]] = (),
                slots: int | None = None, alone: Mapping[str, Alone] | None = None
                ) -> dict[str, Any]:
    """The figures beside the report's tables: the returning users' and post-summary turns' time
    to first token (with what slotwise restored or warmed for them, from its records, and, given
    the server's `slots`, how long each found them all taken, and how long every request did),
    each cold request's first token
    against its own time alone (given what `alone` measured), everyone's longest gap, how many
    requests failed, and all streams' token events per second of the day (the server's output: a
    stream's own rate falls as more streams share a step)."""
    by_id = {str(r.get("id")): r for r in proxy_records}
    ordered = sorted(calls, key=lambda c: c.result.sent)

    def turn(call: Call) -> dict[str, Any]:
        return {**_turn(call, by_id),
                "slot_wait_s": None if slots is None else slot_wait(call, ordered, slots)}
    return {
        "slot_waits": None if slots is None else slot_waits(ordered, slots),
        "returning": [turn(c) for c in ordered if c.act is Act.RETURN],
        "after_summary": [turn(c) for c in ordered if c.act is Act.RESUME],
        "cold": [cold_turn(c, by_id, alone[c.id]) for c in ordered if alone and c.id in alone],
        "first_token_s": first_tokens(ordered),
        "longest_gap_s": longest_gaps(ordered),
        "longest_gap_during": longest_gap_during(ordered),
        "requests": len(ordered),
        "failed": [c.id for c in ordered if not c.ok and not c.cut],
        "cut": [c.id for c in ordered if c.cut],
        "day_s": (day := (max(c.end for c in ordered) - ordered[0].result.sent)
                  if ordered else None),
        "events_per_s": sum(len(c.result.tokens) for c in ordered) / day if day else None,
    }


def first_tokens(calls: Sequence[Call]) -> dict[str, list[float]]:
    """Every request's time to first token by its purpose (`X-Slotwise-Purpose`), those that had
    one: the report's tables count a background job's wait among the short turns, and slotwise
    lets the chat turns have a free slot before the purposes its config names background
    (`prefill.background_purposes`) until they waited `max_hold_s`."""
    out: dict[str, list[float]] = {}
    for call in calls:
        if call.result.ttft is not None:
            out.setdefault(call.purpose, []).append(call.result.ttft)
    return out


def _turn(call: Call, by_id: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    record = by_id.get(call.id, {})
    timings = call.result.timings or {}
    return {"who": call.who, "id": call.id, "ttft_s": call.result.ttft,
            "prompt_tokens": _sum(timings.get("prompt_n"), timings.get("cache_n")),
            "restored_tokens": record.get("restored_tokens"),
            "warmed_tokens": record.get("warmed_tokens"),
            "fed_tokens": record.get("fed_tokens"), "policy_note": record.get("policy_note")}


def computed_for(call: Call, record: Mapping[str, Any]) -> int | None:
    """The prompt tokens computed for `call` on its path: what the server computed for the request
    itself (`timings.prompt_n`) and, through slotwise, the pieces it fed first (its `record`'s; a
    warm-up's and a restore's tokens were ready before it came: not its own)."""
    return None if call.computed is None else call.computed + fed_tokens(record)


def cold_calls(calls: Sequence[Call], proxy_records: Sequence[Mapping[str, Any]],
               long_tokens: int) -> list[Call]:
    """The calls that computed `long_tokens` or more new prompt tokens on their path and had a
    first token (one cut before its first has no size to compute alone)."""
    by_id = {str(r.get("id")): r for r in proxy_records}
    return [c for c in calls if c.result.tokens and c.body is not None
            and (computed_for(c, by_id.get(c.id, {})) or 0) >= long_tokens]


@dataclass(frozen=True)
class Alone:
    """A prompt computed again whole with nothing else running (`alone_body`), as the server's
    timings said."""

    prompt_n: int
    prompt_ms: float

    def seconds(self, tokens: int) -> float:
        """`tokens` of it at the whole prompt's mean rate: a little under their time alone, since a
        token late in a long prompt costs more than one early (the ratio errs against the path)."""
        return self.prompt_ms / 1000.0 * tokens / self.prompt_n if self.prompt_n else 0.0


def alone_body(call: Call) -> dict[str, Any]:
    """`call`'s request, computed whole again (`cache_prompt: false`), one token, not streamed."""
    body = {k: v for k, v in (call.body or {}).items() if k not in ("stream", "stream_options")}
    return {**body, "stream": False, "max_tokens": 1, "cache_prompt": False}


def cold_turn(call: Call, by_id: Mapping[str, Mapping[str, Any]], alone: Alone) -> dict[str, Any]:
    """A cold request's first token against its own new tokens' time alone: the issue's fairness
    aim reads `ttft_s - alone_s`, the time it spent behind others (and stretched beside the
    streams), against `alone_s`."""
    new = computed_for(call, by_id.get(call.id, {})) or 0
    alone_s = alone.seconds(new)
    ttft = call.result.ttft
    return {"who": call.who, "id": call.id, "new_tokens": new, "ttft_s": ttft,
            "alone_s": round(alone_s, 3),
            "times_alone": round(ttft / alone_s, 2) if ttft is not None and alone_s > 0 else None}


def slot_wait(call: Call, everyone: Sequence[Call], slots: int) -> float:
    """How long after `call` was sent the first of the server's `slots` came free: 0 when one was
    idle then. A slot is taken by a request from its prefill's start (`Call.prefill_start`: a
    request slotwise holds, or feeds in pieces, takes none meanwhile) to its end; slotwise's own
    warm-ups and restores are left out, since taking a slot for them is its own choice."""
    sent = call.result.sent
    ends = sorted(o.end for o in everyone if o is not call and o.prefill_start is not None
                  and o.prefill_start <= sent < o.end)
    return 0.0 if len(ends) < slots else ends[len(ends) - slots] - sent


def slot_waits(calls: Sequence[Call], slots: int) -> list[float]:
    """How long each request that found every slot taken waited for one, in order of sending, as
    llama-server hands its slots out: each request, in the order they were sent, takes the first
    slot to come free and keeps it to its end (a task is given a free slot at once, LoRA or not,
    and deferred tasks get released slots oldest first: docs/llama-server-notes.md 4.5). Unlike
    `slot_wait`, a request stuck in a slot counts: on the direct paths the LoRA client's first
    turn sat in one for three minutes. The share of the short turns' time to first token that
    more slots would have spared, on every path alike (slotwise's own warm-ups and restores left
    out)."""
    free = [0.0] * slots
    waits = []
    for call in sorted(calls, key=lambda c: c.result.sent):
        sent = call.result.sent
        start = max(sent, heapq.heappop(free))
        heapq.heappush(free, max(start, call.end))
        if start > sent:
            waits.append(round(start - sent, 3))
    return waits


def _sum(a: object, b: object) -> int | None:
    return a + b if isinstance(a, int) and isinstance(b, int) else None


def longest_gap_during(calls: Sequence[Call]) -> list[str]:
    """What the server computed during everyone's longest gap: the other requests whose prefill
    overlapped it, each with the tokens it computed, so that a reader sees what froze the
    streams (a short turn sent whole, a translation, a cold request's rest). Empty when none did:
    slotwise's pieces fed ahead, its restores and warm-ups are not the day's requests."""
    longest: tuple[Call, float, float] | None = None
    for call in calls:
        for a, b in itertools.pairwise(call.result.tokens):
            if longest is None or b - a > longest[2] - longest[1]:
                longest = (call, a, b)
    if longest is None:
        return []
    stalled, start, end = longest
    out = []
    for other in calls:
        span = other.prefill
        if other is not stalled and span is not None and span[0] < end and span[1] > start:
            out.append(other.id if other.computed is None
                       else f"{other.id} ({other.computed:,} tokens)")
    return out


def longest_gaps(calls: Sequence[Call]) -> dict[str, float | None]:
    """Each client's longest gap between two token events of one reply, and everyone's."""
    out: dict[str, float | None] = {}
    for call in calls:
        gaps = [b - a for a, b in itertools.pairwise(call.result.tokens)]
        if gaps:
            out[call.who] = max(max(gaps), out.get(call.who) or 0.0)
        else:
            out.setdefault(call.who, None)
    known = [v for v in out.values() if v is not None]
    out["everyone"] = max(known) if known else None
    return out
