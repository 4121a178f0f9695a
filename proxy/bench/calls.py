"""A request as its client timed it (`Call`), sent and kept the one way `bench day` and `bench
contention` both send theirs (`timed_call`, the only I/O here), and the timing records in slotwise's
own format made from such calls for the paths that go to llama-server directly (`client_log`), so
that `slotwise report` and `slotwise whatif` read every path alike.

A direct request's record follows docs/record.md from the client's side: its prefill starts the
server's `prompt_ms` before its first token (what its wait excludes, as in the field report), so
`prefill_wait_ms` is that start − sent, and `overlaps` are the other requests' prefills that
overlapped its life, with its own decode inside them (`proxy/record/schema.py` does the same from
slotwise's registry).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import orjson

from proxy.bench.harness import StreamResult, timed_stream
from proxy.record.schema import decode_inside

CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass(frozen=True)
class Call:
    """One request as its client saw it (times are the client's monotonic clock)."""

    id: str
    who: str
    act: str
    """What the user does (`bench day`'s `Act`; `chat` elsewhere)."""
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


async def timed_call(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                     headers: Mapping[str, str], calls: list[Call], *, request_id: str, who: str,
                     act: str, purpose: str) -> Call:
    """One streaming chat request, kept in `calls` whatever happens: a failed one with what it saw
    before it failed, a cancelled one (the run ended while it ran: its client left) as cut."""
    result, cut = StreamResult(sent=time.monotonic()), False
    try:
        await timed_stream(http, url, body, detail=True, headers=headers, into=result)
    except (aiohttp.ClientError, TimeoutError):
        pass  # a failed call: what it saw before it failed
    except asyncio.CancelledError:
        cut = True  # its first token and gaps so far still count
        raise
    finally:
        result.ended = time.monotonic() if result.ended is None else result.ended
        call = Call(request_id, who, act, purpose, body.get("lora"), result, cut=cut, body=body)
        calls.append(call)
    return call


def client_log(calls: Sequence[Call], wall_offset: float) -> bytes:
    """The calls as timing records, JSON lines (`client_records`)."""
    return b"".join(orjson.dumps(r) + b"\n" for r in client_records(calls, wall_offset))


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
