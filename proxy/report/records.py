"""Loading slotwise's timing log (one JSON record per line) and turning records into spans.

Lines that are not JSON objects are counted, never dropped silently. Times in records are ISO 8601
UTC; on the span axis they become seconds since the Unix epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from proxy.report.model import Segment, Span

RecordLine = Mapping[str, Any]
COMPLETION_KINDS = frozenset({"chat", "completions", "completion", "infill", "messages",
                              "responses"})


class InputError(ValueError):
    """An input the report cannot use; the message is one line for the user."""


@dataclass(frozen=True)
class LoadedTimingLog:
    """A timing log as the report read it: its records and the lines that were not one (the proxy's
    writer of the log is `proxy/record/timing_log.py` `TimingLog`)."""

    path: str
    records: tuple[RecordLine, ...]
    lines: int
    bad_lines: tuple[int, ...]
    """Line numbers that were not a JSON object with a valid `start`."""


def parse_time(text: str, what: str = "time") -> float:
    """ISO 8601 date or date-time to epoch seconds; a naive time is taken as UTC."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InputError(
            f"{what}: {text!r} is not a time; use ISO 8601, e.g. 2025-11-06 or 2025-11-06T07:57:00Z"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def load_timing_log(path: str) -> LoadedTimingLog:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read timing log {path}: {exc.strerror or exc}") from None
    records: list[RecordLine] = []
    bad: list[int] = []
    lines = data.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _parse_line(line)
        if record is None:
            bad.append(number)
        else:
            records.append(record)
    if lines and not records:
        raise InputError(f"{path}: no timing records (none of its {len(lines)} lines is a JSON record)")
    records.sort(key=start_of)
    return LoadedTimingLog(path, tuple(records), len(lines), tuple(bad))


def _parse_line(line: bytes) -> RecordLine | None:
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("start"), str):
        return None
    try:
        value["_t0"] = parse_time(value["start"])
    except InputError:
        return None
    return value


def start_of(record: RecordLine) -> float:
    return float(record["_t0"])


def select(records: Iterable[RecordLine], since: float | None, until: float | None) -> list[RecordLine]:
    """Records that arrived in [since, until)."""
    return [
        r
        for r in records
        if (since is None or start_of(r) >= since) and (until is None or start_of(r) < until)
    ]


def num(record: RecordLine, key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def timing(record: RecordLine, key: str) -> float | None:
    timings = record.get("timings")
    return num(timings, key) if isinstance(timings, Mapping) else None


def fed_tokens(record: RecordLine) -> int:
    """Prompt tokens computed ahead of the request in pieces (`chunk` policy); 0 in older logs."""
    return int(num(record, "fed_tokens") or 0)


def prompt_split(record: RecordLine) -> tuple[int | None, int | None]:
    """(computed, cached) prompt tokens of the request itself: the server's `timings`, or where
    the API gives none (Anthropic messages, responses) the record's `computed_tokens` and
    `prompt_tokens` (read from `usage`)."""
    prompt_n, cache_n = _int(timing(record, "prompt_n")), _int(timing(record, "cache_n"))
    if prompt_n is not None:
        return prompt_n, cache_n
    computed, total = _int(num(record, "computed_tokens")), _int(num(record, "prompt_tokens"))
    if computed is None:
        return None, None
    return computed, None if total is None else max(0, total - computed)


def new_tokens(record: RecordLine) -> float | None:
    """The prompt tokens the server computed for a request: `timings.prompt_n` (or
    `computed_tokens`) plus its pieces."""
    prompt_n, _ = prompt_split(record)
    return None if prompt_n is None else prompt_n + fed_tokens(record)


def overlap_tokens(overlap: Mapping[str, Any]) -> float | None:
    """The prompt tokens an overlapping prefill computed (`new_tokens` in logs before 0.2)."""
    value = num(overlap, "computed_tokens")
    return num(overlap, "new_tokens") if value is None else value


def is_turn(record: RecordLine) -> bool:
    """A generation request that completed: what the field report calls a turn."""
    return record.get("kind") in COMPLETION_KINDS and record.get("outcome") == "done"


def lora_key(lora: object) -> str:
    """Canonical LoRA settings: adapters with a non-zero scale, by id; absent = server default."""
    if lora is None:
        return "default"
    if not isinstance(lora, Sequence):
        return repr(lora)
    parts = []
    for entry in lora:
        if isinstance(entry, Mapping) and entry.get("scale", 1.0) != 0:
            parts.append(f"{entry.get('id')}:{entry.get('scale', 1.0)}")
    return ",".join(sorted(parts)) or "none"


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def first_pieces(records: Iterable[RecordLine]) -> dict[str, float]:
    """When each request fed in pieces began its first piece (epoch s), from the others' records:
    an overlap that begins after another request's arrival (`from_ms` > 0) begins exactly when
    the prefill, i.e. the first piece, began."""
    fed = {str(r.get("id")) for r in records if r.get("pieces")}
    found: dict[str, float] = {}
    for record in records:
        for ov in record.get("overlaps") or ():
            if not isinstance(ov, Mapping) or str(ov.get("id")) not in fed:
                continue
            from_ms = num(ov, "from_ms")
            if from_ms:
                at = start_of(record) + from_ms / 1000
                key = str(ov.get("id"))
                found[key] = min(found.get(key, at), at)
    return found


def record_to_span(record: RecordLine, first_piece: Mapping[str, float] | None = None) -> Span:
    t0 = start_of(record)
    wait, ttft = num(record, "prefill_wait_ms"), num(record, "ttft_ms")
    total = num(record, "total_ms") or 0.0
    inflight = record.get("inflight_at_start")
    prompt_n, cache_n = prompt_split(record)
    gap_ms, gap_at_ms = num(record, "gap_max_ms"), num(record, "gap_max_at_ms")
    if prompt_n is None and record.get("kind") == "warm":
        prompt_n = 0  # a warm-up computes nothing of its own: its new tokens are its pieces'
    return Span(
        key=str(record.get("id")),
        start=t0,
        end=t0 + total / 1000,
        kind=_str(record.get("kind")),
        prefill_start=None if wait is None else t0 + wait / 1000,
        first_token=None if ttft is None else t0 + ttft / 1000,
        prompt_n=prompt_n,
        cache_n=cache_n,
        fed_n=fed_tokens(record),
        pieces=int(num(record, "pieces") or 0),
        first_piece=(first_piece or {}).get(str(record.get("id"))),
        predicted_n=_int(timing(record, "predicted_n")),
        prompt_ms=timing(record, "prompt_ms"),
        predicted_ms=timing(record, "predicted_ms"),
        client=_str(record.get("client")),
        purpose=_str(record.get("purpose")),
        lora=lora_key(record.get("lora_out")),
        running_at_start=tuple(str(i) for i in inflight) if isinstance(inflight, list) else None,
        longest_gap_start=None if gap_ms is None or gap_at_ms is None else t0 + gap_at_ms / 1000,
        longest_gap_s=None if gap_ms is None else gap_ms / 1000,
        segments=tuple(_segments(record, t0)),
        info=_info(record),
    )


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _segments(record: RecordLine, t0: float) -> Iterable[Segment]:
    ttft, decode_ms = num(record, "ttft_ms"), num(record, "decode_ms")
    if ttft is None or not decode_ms:
        return
    d0, d1 = ttft, ttft + decode_ms
    for ov in record.get("overlaps") or ():
        if not isinstance(ov, Mapping):
            continue
        ms, events = num(ov, "decode_ms"), num(ov, "decode_events")
        start, end = max(d0, num(ov, "from_ms") or d0), min(d1, num(ov, "to_ms") or d1)
        if ms and events is not None and end > start:
            tokens = overlap_tokens(ov)
            shown = "?" if tokens is None else f"{tokens:.0f}"
            why = f"during prefill of {ov.get('id')} ({shown} new tokens)"
            yield Segment(t0 + start / 1000, t0 + end / 1000, events / (ms / 1000), why)


_POLICY_KEYS = ("held_ms", "pieces", "fed_tokens", "est_new_tokens", "policy_note")


def _info(record: RecordLine) -> tuple[tuple[str, str], ...]:
    keys = (
        "id",
        "purpose",
        "client",
        "outcome",
        "total_ms",
        "prefill_wait_ms",
        "ttft_ms",
        "decode_ms",
        "events",
        "gap_max_ms",
        "gap_max_at_ms",
        "worst_3s_rate",
        "prefill_plan",
        "lora_rewritten",
    )
    pairs = [(k, str(record.get(k))) for k in keys if record.get(k) is not None]
    # The policy's figures only where it acted or said something.
    pairs += [(k, str(record.get(k))) for k in _POLICY_KEYS if record.get(k)]
    for k in ("prompt_n", "cache_n", "predicted_n"):
        value = timing(record, k)
        if value is not None:
            pairs.append((k, str(int(value))))
    return tuple(pairs)
