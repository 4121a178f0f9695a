"""What the day's client saw, turned into figures (pure): each request as the client timed it
(`Call`); for the direct paths, timing records in slotwise's own format made from those calls, so
that `slotwise report`'s tables (proxy/report) are built the same way on every path; and the day's
own figures: each returning user's and each post-summary turn's time to first token (and how long it
found every slot taken), each cold request's first token against its own time alone, and everyone's
longest gap between tokens (and the prefills that ran during it).

A direct request's record follows docs/record.md from the client's side: its prefill starts the
server's `prompt_ms` before its first token (what its wait excludes, as in the field report), so
`prefill_wait_ms` is that start − sent, and `overlaps` are the other requests' prefills that
overlapped its life, with its own decode inside them (`proxy/record/schema.py` does the same from
slotwise's registry).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from proxy.bench.day import Act
from proxy.bench.harness import StreamResult
from proxy.record.schema import decode_inside
from proxy.report.records import fed_tokens

CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass(frozen=True)
class Call:
    """One request of the day as its client saw it (times are the client's monotonic clock)."""

    id: str
    who: str
    act: Act
    purpose: str
    lora: list[dict[str, Any]] | None
    result: StreamResult
    cut: bool = False
    """The day ended while it ran (its client closed it, as a user leaving would)."""
    body: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)
    """What it sent (its prompt is computed again alone after the day: `alone_body`)."""

    @property
    def prefill_start(self) -> float | None:
        """When the slot began computing the prompt: the first token less the server's own
        `prompt_ms`; without timings, the response headers."""
        r = self.result
        prompt_ms = (r.timings or {}).get("prompt_ms")
        if r.tokens and isinstance(prompt_ms, int | float):
            return max(r.sent, r.tokens[0] - prompt_ms / 1000.0)
        return r.headers

    @property
    def prefill(self) -> tuple[float, float] | None:
        """From the prefill's start to the first token (or the end, without one)."""
        start = self.prefill_start
        if start is None:
            return None
        return start, self.result.tokens[0] if self.result.tokens else max(start, self.end)

    @property
    def end(self) -> float:
        return self.result.ended if self.result.ended is not None else self.result.sent

    @property
    def computed(self) -> int | None:
        value = (self.result.timings or {}).get("prompt_n")
        return value if isinstance(value, int) else None

    @property
    def ok(self) -> bool:
        """It streamed its reply: to the end, or until the day was cut."""
        return self.result.status == 200 and bool(self.result.tokens)

    @property
    def outcome(self) -> str:
        """As slotwise's record says it: a call the day cut is one its client left."""
        if self.cut:
            return "client_gone"
        return "done" if self.ok else "upstream_error"


def client_records(calls: Sequence[Call], wall_offset: float) -> list[dict[str, Any]]:
    """The calls as timing records, in order of sending; `wall_offset` turns the client's monotonic
    clock into Unix time (for the records' `start`)."""
    ordered = sorted(calls, key=lambda c: c.result.sent)
    return [client_record(call, ordered, wall_offset) for call in ordered]


def client_record(call: Call, everyone: Sequence[Call], wall_offset: float) -> dict[str, Any]:
    r, tokens = call.result, call.result.tokens
    timings = r.timings or {}
    prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
    gaps = [b - a for a, b in itertools.pairwise(tokens)]
    return {
        "id": call.id, "start": datetime.fromtimestamp(r.sent + wall_offset, UTC).isoformat(),
        "method": "POST", "endpoint": CHAT_ENDPOINT, "kind": "chat", "status": r.status,
        "stream": True, "outcome": call.outcome,
        "client": call.who, "purpose": call.purpose,
        "ttft_ms": _ms(r.sent, tokens[0]) if tokens else None,
        "decode_ms": _ms(tokens[0], tokens[-1]) if tokens else None,
        "total_ms": _ms(r.sent, call.end), "events": len(tokens),
        "gap_max_ms": round(max(gaps) * 1000.0, 1) if gaps else None,
        "prefill_wait_ms": None if call.prefill_start is None else _ms(r.sent, call.prefill_start),
        "timings": r.timings,
        "prompt_tokens": prompt_n + cache_n if isinstance(prompt_n, int)
        and isinstance(cache_n, int) else None,
        "computed_tokens": prompt_n if isinstance(prompt_n, int) else None,
        "fed_tokens": 0, "pieces": 0, "lora_out": call.lora,
        "inflight_at_start": [o.id for o in everyone
                              if o is not call and o.result.sent <= r.sent < o.end],
        "overlaps": overlaps(call, everyone),
    }


def overlaps(call: Call, everyone: Sequence[Call]) -> list[dict[str, Any]]:
    """Every other call whose prefill overlapped this one's life, with this one's decode in it."""
    sent, end, found = call.result.sent, call.end, []
    for peer in everyone:
        span = peer.prefill
        if peer is call or span is None:
            continue
        lo, hi = max(span[0], sent), min(span[1], end)
        if hi <= lo:
            continue
        events, decode_s = decode_inside(call.result.tokens, lo, hi)
        found.append({"id": peer.id, "computed_tokens": peer.computed, "from_ms": _ms(sent, lo),
                      "to_ms": _ms(sent, hi), "decode_events": events,
                      "decode_ms": round(decode_s * 1000.0, 1)})
    return found


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1000.0, 1)


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
        "longest_gap_s": longest_gaps(ordered),
        "longest_gap_during": longest_gap_during(ordered),
        "requests": len(ordered),
        "failed": [c.id for c in ordered if not c.ok and not c.cut],
        "cut": [c.id for c in ordered if c.cut],
        "day_s": (day := (max(c.end for c in ordered) - ordered[0].result.sent)
                  if ordered else None),
        "events_per_s": sum(len(c.result.tokens) for c in ordered) / day if day else None,
    }


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
