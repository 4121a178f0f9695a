"""The timing record: the one typed, frozen value each request leaves (fields: docs/record.md).

`build_record` reads a finished `Flight` once and makes the `Record`; the timing log, the metrics
and the status page all take it as it is. Pure: it never sees prompt or generated text.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

import orjson

from proxy.record.clientstrings import MAX_CHARS, clean_id, clean_text, safe_text
from proxy.record.flight import Flight
from proxy.record.outcome import Outcome

MAX_PATH_CHARS = 512
MAX_ERROR_CHARS = 1000
MAX_LORA_BYTES = 2048
"""A `lora` field larger than this as JSON is not copied into the record (it is the client's value)."""
MAX_OVERLAPS = 32
"""The most overlaps one record lists (its biggest prefills); `overlaps_total` counts them all. A
long request beside thousands of short ones made one record a line of hundreds of KiB."""


@dataclass(frozen=True, slots=True)
class Overlap:
    """Another request whose prefill overlapped this one's life, and this one's decode inside it."""

    id: str
    computed_tokens: int | None
    from_ms: float
    to_ms: float
    decode_events: int
    decode_ms: float


@dataclass(frozen=True, slots=True)
class Record:
    """One request, as written to the timing log (one JSON line, fields in this order)."""

    id: str
    start: str | None = None
    method: str | None = None
    endpoint: str | None = None
    kind: str | None = None
    status: int | None = None
    stream: bool = False
    outcome: Outcome = Outcome.DONE
    error: str | None = None
    client: str | None = None
    purpose: str | None = None
    config_gen: int | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    proxy_ms: float | None = None
    queue_ms: float | None = None
    prefill_ms: float | None = None
    ttft_ms: float | None = None
    decode_ms: float | None = None
    total_ms: float = 0.0
    events: int = 0
    gap_p50_ms: float | None = None
    gap_p95_ms: float | None = None
    gap_max_ms: float | None = None
    gap_max_at_ms: float | None = None
    worst_3s_rate: float | None = None
    prefill_wait_ms: float | None = None
    prompt_tokens: int | None = None
    computed_tokens: int | None = None
    fed_tokens: int = 0
    timings: dict[str, Any] | None = None
    lora_in: Any = None
    lora_out: Any = None
    lora_rewritten: bool = False
    progress_added: bool = False
    inflight_at_start: tuple[str, ...] = ()
    overlaps: tuple[Overlap, ...] = ()
    overlaps_total: int = 0
    prefill_plan: str = "none"
    held_ms: float = 0.0
    slot_wait_ms: float = 0.0
    pieces: int = 0
    est_prompt_tokens: int | None = None
    est_new_tokens: int | None = None
    policy_note: str | None = None
    node: str | None = None
    warmed_tokens: int = 0
    warm_ids: tuple[str, ...] = ()
    restored_tokens: int = 0
    kv_file: str | None = None
    kv_tokens: int | None = None
    kv_bytes: int = 0
    refused_count: int = 0
    peer: str | None = None

    def to_json(self) -> bytes:
        """The timing log's line for this record, newline included."""
        return orjson.dumps(self, option=orjson.OPT_APPEND_NEWLINE)

    def to_dict(self) -> dict[str, Any]:
        """The record as the JSON object the log holds (tests, the status page's JSON)."""
        value: dict[str, Any] = orjson.loads(self.to_json())
        return value


RECORD_FIELDS = tuple(f.name for f in fields(Record))
OVERLAP_FIELDS = tuple(f.name for f in fields(Overlap))


def build_record(flight: Flight) -> Record:
    """The record of a finished request. Every string the client chose is capped and printable
    already (`proxy/record/clientstrings.py`); they are made safe once more here, so a record can
    always be written as JSON whatever reached the `Flight`."""
    timer, prefill = flight.timer, flight.prefill
    figures = timer.figures()
    every_overlap = overlaps(flight)
    return Record(
        id=clean_id(flight.id, MAX_CHARS + 8) or "-",
        start=datetime.fromtimestamp(flight.wall_start, UTC).isoformat(timespec="milliseconds"),
        method=safe_text(flight.method, 32), endpoint=safe_text(flight.endpoint, MAX_PATH_CHARS),
        kind=str(flight.kind), status=flight.status, stream=flight.stream, outcome=flight.outcome,
        error=safe_text(flight.error, MAX_ERROR_CHARS),
        client=clean_text(flight.client), purpose=clean_text(flight.purpose),
        config_gen=flight.config_gen,
        bytes_in=flight.bytes_in, bytes_out=flight.bytes_out,
        **figures,
        prefill_wait_ms=prefill_wait_ms(flight, flight.timings),
        prompt_tokens=flight.prompt_tokens, computed_tokens=flight.computed_tokens,
        fed_tokens=prefill.fed_tokens, timings=flight.timings,
        lora_in=bounded_lora(flight.lora_in), lora_out=bounded_lora(flight.lora_out),
        lora_rewritten=flight.lora_rewritten, progress_added=flight.progress_added,
        inflight_at_start=tuple(flight.inflight_at_start), overlaps=biggest(every_overlap),
        overlaps_total=len(every_overlap),
        prefill_plan=str(prefill.plan), held_ms=prefill.held_ms,
        slot_wait_ms=prefill.slot_wait_ms, pieces=prefill.pieces,
        est_prompt_tokens=prefill.est_prompt_tokens, est_new_tokens=prefill.est_new_tokens,
        policy_note=safe_text(prefill.note, MAX_ERROR_CHARS), node=flight.node,
        warmed_tokens=flight.warmed_tokens, warm_ids=tuple(flight.warm_ids),
        restored_tokens=flight.restored_tokens, kv_file=safe_text(flight.kv_file, MAX_PATH_CHARS),
        kv_tokens=flight.kv_tokens, kv_bytes=flight.kv_bytes,
    )


def bounded_lora(value: Any) -> Any:
    """A `lora` field as it is, unless its JSON is over `MAX_LORA_BYTES`: then a note of its size."""
    if value is None or isinstance(value, bool | int | float):
        return value
    try:
        size = len(orjson.dumps(value))
    except TypeError:
        return "(not recorded: a lora field that is not JSON)"
    return value if size <= MAX_LORA_BYTES else f"(not recorded: a lora field of {size} bytes)"


def prefill_wait_ms(flight: Flight, timings: dict[str, Any] | None) -> float | None:
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


def overlaps(flight: Flight) -> tuple[Overlap, ...]:
    """Every other request whose prefill overlapped this one's life, with this one's decode in it."""
    timer = flight.timer
    end = timer.ended if timer.ended is not None else timer.arrived
    result = []
    for peer in flight.prefill_peers:
        if peer.start is None:
            continue
        lo = max(peer.start, timer.arrived)
        hi = min(peer.end if peer.end is not None else end, end)
        if hi <= lo:
            continue
        events, decode_s = decode_inside(timer.tokens, lo, hi)
        result.append(Overlap(
            id=peer.id, computed_tokens=peer.computed_tokens,
            from_ms=round((lo - timer.arrived) * 1000.0, 1),
            to_ms=round((hi - timer.arrived) * 1000.0, 1),
            decode_events=events, decode_ms=round(decode_s * 1000.0, 1)))
    return tuple(result)


def biggest(found: tuple[Overlap, ...], limit: int = MAX_OVERLAPS) -> tuple[Overlap, ...]:
    """The `limit` overlaps with the most computed tokens (an unknown count counts 0; the earlier
    first among equals), in time order."""
    if len(found) <= limit:
        return found
    ranked = sorted(range(len(found)), key=lambda i: (-(found[i].computed_tokens or 0), i))
    return tuple(found[i] for i in sorted(ranked[:limit]))


def decode_inside(tokens: list[float], lo: float, hi: float) -> tuple[int, float]:
    """Token events in (lo, hi] and how long this request was decoding within [lo, hi]."""
    if len(tokens) < 2:
        return 0, 0.0
    events = bisect.bisect_right(tokens, hi) - bisect.bisect_right(tokens, lo)
    span = min(hi, tokens[-1]) - max(lo, tokens[0])
    return events, max(span, 0.0)
