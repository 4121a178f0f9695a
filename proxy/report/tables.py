"""Aggregation shared by both commands: pure functions from spans to tables.

Each function takes the turns to describe and a `SpanIndex` of every span in the same log (so
contention counts requests that are not turns too), and returns one `Table`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from proxy.report.model import Row, Span, Table, quantile, summary
from proxy.report.spanindex import SpanIndex


@dataclass(frozen=True)
class Thresholds:
    cache_hit: float = 0.95
    """A turn is a cache hit when at least this share of its prompt was cached."""
    big_new: int = 5000
    """A prefill of at least this many new tokens is large."""
    long_prefill: int = 15000
    """The prefill size whose effect on other streams' decode rate is measured."""
    short_new: int = 1000
    """A short turn has fewer new tokens than this."""
    min_wait_s: float = 1.0
    """Waits before the prefill at least this long are listed."""
    min_stall_s: float = 1.0
    """A stream's longest gap between token events at least this long is a stall, listed."""
    pause_s: float = 1800.0
    """A client's first turn after this much silence counts as a cold start."""


def _stat_row(label: str, values: Sequence[float], qs: Sequence[float]) -> Row:
    return Row(label, len(values), summary(values, qs))


def turns_table(turns: Sequence[Span], th: Thresholds) -> Table:
    total = [s.total_s for s in turns]

    def where(pred: Callable[[Span], bool]) -> list[float]:
        return [s.total_s for s in turns if pred(s)]

    rows = [
        _stat_row("all turns", total, (0.5, 0.95)),
        _stat_row(f"of which >= {th.cache_hit:.0%} cached", where(lambda s: _hit(s, th)), (0.5, 0.95)),
        _stat_row(
            f"of which >= {th.big_new:,} new tokens",
            where(lambda s: (s.new_n or 0) >= th.big_new),
            (0.5, 0.95),
        ),
    ]
    for purpose in sorted({s.purpose for s in turns if s.purpose is not None}):
        values = [s.total_s for s in turns if s.purpose == purpose]
        rows.append(_stat_row(f"purpose {purpose}", values, (0.5, 0.95)))
    return Table("turns", "Turns: total time", ("median", "p95", "max"), ("s", "s", "s"), tuple(rows))


def _hit(span: Span, th: Thresholds) -> bool:
    """At least `cache_hit` of the prompt was cached when the turn arrived: tokens its own pieces
    put in the cache do not count (a chunked cold turn is no cache hit)."""
    if span.prompt_n is None or span.cache_n is None or span.prompt_n + span.cache_n == 0:
        return False
    return (span.cached_n or 0) / (span.prompt_n + span.cache_n) >= th.cache_hit


def alone_rates(turns: Sequence[Span], index: SpanIndex) -> tuple[float | None, float | None, int]:
    """Decode and prefill tokens per second of the turns that ran alone, and how many there were."""
    alone_keys = index.alone()
    alone = [s for s in turns if s.key in alone_keys]
    dec_pairs = [(s.predicted_n, s.predicted_ms) for s in alone if s.predicted_n and s.predicted_ms]
    pre_pairs = [(s.prompt_n, s.prompt_ms) for s in alone if s.prompt_n and s.prompt_ms]

    def rate(pairs: list[tuple[int, float]]) -> float | None:
        ms = sum(p[1] for p in pairs)
        return sum(p[0] for p in pairs) / (ms / 1000) if ms > 0 else None

    return rate(dec_pairs), rate(pre_pairs), len(alone)


FASTEST_MIN_TOKENS = 64
"""A turn's own rate stands in for the alone rate only if it computed or generated this many."""


def fastest_rates(turns: Sequence[Span]) -> tuple[float | None, float | None]:
    """The fastest decode and prefill rates any turn reached (tokens per second). Contention only
    slows a turn down, so these are at most the rates alone."""
    def best(pairs: Iterable[tuple[int | None, float | None]]) -> float | None:
        rates = [n * 1000 / ms for n, ms in pairs if n and n >= FASTEST_MIN_TOKENS and ms]
        return max(rates, default=None)

    return (best((s.predicted_n, s.predicted_ms) for s in turns),
            best((s.prompt_n, s.prompt_ms) for s in turns))


def time_split_table(turns: Sequence[Span], index: SpanIndex) -> Table:
    decode_rate, prefill_rate, n_alone = alone_rates(turns, index)
    title = "Where the time went"
    columns, units = ("seconds", "share"), ("s", "%")
    source = f"rates of the {n_alone} requests that ran alone"
    if decode_rate is None or prefill_rate is None:
        fast_decode, fast_prefill = fastest_rates(turns)
        decode_rate, prefill_rate = decode_rate or fast_decode, prefill_rate or fast_prefill
        source = ("no turn ran alone with both prefill and decode, so the fastest rates any turn "
                  "reached stand in and the increment caused by others is a lower bound")
    if decode_rate is None or prefill_rate is None:
        rows = tuple(Row(label, len(turns), (None, None)) for label in _SPLIT_LABELS)
        return Table(
            "time_split",
            title,
            columns,
            units,
            rows,
            note="no turn ran alone with both prefill and decode, and no turn shows a "
            f"{_missing(decode_rate, prefill_rate)} rate of its own over {FASTEST_MIN_TOKENS} "
            "tokens: no rates to compare against",
        )
    own_decode = sum((s.predicted_n or 0) / decode_rate for s in turns)
    own_prefill = sum((s.new_n or 0) / prefill_rate for s in turns)  # pieces included
    total = sum(s.total_s for s in turns)
    parts = (own_decode, own_prefill, total - own_decode - own_prefill, total)
    rows = tuple(
        Row(label, len(turns), (value, 100 * value / total if total else None))
        for label, value in zip(_SPLIT_LABELS, parts, strict=True)
    )
    note = f"{source}: decode {decode_rate:.1f} tok/s, prefill {prefill_rate:.0f} tok/s"
    return Table("time_split", title, columns, units, rows, note=note)


def _missing(decode_rate: float | None, prefill_rate: float | None) -> str:
    missing = [name for name, rate in (("prefill", prefill_rate), ("decode", decode_rate))
               if rate is None]
    return " or ".join(missing)


_SPLIT_LABELS = ("own decode", "own prefill", "increment caused by others (waits, shared steps)", "total")


def contention(span: Span, index: SpanIndex, big_new: int) -> str:
    """What else ran between a span's arrival and its first token."""
    end = span.first_token if span.first_token is not None else span.end
    others = list(index.active(span.start, end, span.key))
    for other in others:
        o_start = other.compute_start  # a prompt fed in pieces: from its first piece
        if (other.new_n or 0) >= big_new and o_start < end and other.compute_end > span.start:
            return "long"
    return "others" if others else "alone"


def ttft_table(turns: Sequence[Span], index: SpanIndex, th: Thresholds) -> Table:
    groups: dict[str, list[float]] = defaultdict(list)
    for s in turns:
        if s.ttft_s is not None and s.new_n is not None and s.new_n < th.short_new:
            groups[contention(s, index, th.big_new)].append(s.ttft_s)
    labels = {
        "alone": "nothing else running",
        "others": "overlapping other requests",
        "long": f"overlapping a prefill of >= {th.big_new:,} tokens",
    }
    rows = tuple(_stat_row(label, groups[k], (0.5, 0.9)) for k, label in labels.items())
    return Table(
        "ttft_short",
        f"Time to first token, short turns (< {th.short_new:,} new tokens)",
        ("median", "p90", "max"),
        ("s", "s", "s"),
        rows,
    )


def waits_table(spans: Sequence[Span], index: SpanIndex, th: Thresholds) -> Table:
    groups: dict[str, list[float]] = defaultdict(list)
    fed = 0
    for s in spans:
        wait = s.wait_s
        if wait is not None and wait >= th.min_wait_s:
            if s.pieces:  # its "wait" includes the computing of its pieces: not a wait
                fed += 1
                continue
            groups[_running_kind(s, index)].append(wait)
    labels = (
        "requests with other LoRA settings",
        "requests with the same LoRA settings",
        "other requests (LoRA unknown)",
        "nothing",
    )
    every = [w for k in labels for w in groups[k]]
    rows = [
        Row(k, len(groups[k]), (sum(groups[k]), max(groups[k], default=None)))
        for k in labels
        if groups[k] or k != labels[2]
    ]
    rows.append(Row("in all", len(every), (sum(every), max(every, default=None))))
    return Table(
        "waits",
        f"Waits of {th.min_wait_s:g} s or more before the prefill, by what was running meanwhile",
        ("total", "max"),
        ("s", "s"),
        tuple(rows),
        note=f"left out: {fed} request(s) fed in pieces ahead (chunk), whose time before the "
        "prefill of the rest was mostly the computing of their pieces" if fed else "",
    )


def _running_kind(span: Span, index: SpanIndex) -> str:
    running = index.running_at_start(span)
    if not running:
        return "nothing"
    if span.lora is None or any(o.lora is None for o in running):
        return "other requests (LoRA unknown)"
    if any(o.lora != span.lora for o in running):
        return "requests with other LoRA settings"
    return "requests with the same LoRA settings"


def sources_table(spans: Sequence[Span], th: Thresholds) -> Table:
    groups: dict[str, list[int]] = defaultdict(list)
    last: dict[str, Span] = {}
    for s in sorted(spans, key=lambda x: x.start):
        if (s.new_n or 0) >= th.big_new:
            groups[_source(s, last.get(s.client or ""), th)].append(s.new_n or 0)
        if s.client is not None:
            last[s.client] = s
    rows = tuple(
        Row(k, len(v), (float(sum(v)), statistics.median(v)))
        for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    )
    return Table(
        "sources",
        f"Sources of prefills of >= {th.big_new:,} new tokens",
        ("new tokens", "median"),
        ("tok", "tok"),
        rows,
    )


def _source(span: Span, previous: Span | None, th: Thresholds) -> str:
    if span.client is not None and (previous is None or span.start - previous.end >= th.pause_s):
        return f"first turn of a client (in the log, or after >= {th.pause_s / 60:g} min)"
    if previous is not None and previous.purpose is not None and previous.purpose != span.purpose:
        return f"turn right after a '{previous.purpose}' request of the same client"
    if span.purpose is not None:
        return f"purpose '{span.purpose}'"
    return "other" if span.client is not None else "other (no client id)"


def overview_table(turns: Sequence[Span], index: SpanIndex, untimed: int = 0) -> Table:
    """`untimed`: requests counted only in a summary of refusals (docs/record.md), without times."""
    spans = index.spans
    hours = (max(s.end for s in spans) - spans[0].start) / 3600 if spans else 0.0
    ttfts = [s.ttft_s for s in turns if s.ttft_s is not None]
    requests = len(spans) + untimed
    rows = (
        Row("requests", requests, (float(requests),)),
        Row("turns", len(turns), (float(len(turns)),)),
        Row("turns per hour", len(turns), (len(turns) / hours if hours else None,)),
        Row("time with 2+ requests running", len(spans), (index.busy_seconds(2),), unit="s"),
        Row("time to first token p95, all turns", len(ttfts), (quantile(ttfts, 0.95),), unit="s"),
    )
    return Table("overview", "Overview", ("value",), ("",), rows)
