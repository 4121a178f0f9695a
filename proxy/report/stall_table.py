"""The stalls table: each stream's longest gap between token events, by what was computed during it
(another request's prompt sent whole, one fed in pieces, a warm-up, a kept KV save or restore, or
nothing seen). Pure, over the report's spans.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.record.kind import Kind
from proxy.report.cells import fmt
from proxy.report.model import Row, Span, Table, overlap
from proxy.report.spanindex import SpanIndex
from proxy.report.tables import Thresholds

STALL_LABELS = {
    "whole": "another request's prompt, sent whole",
    "pieces": "a prompt fed in pieces (chunk)",
    "warm": "a warm-up",
    "kv": "a kept KV save or restore",
    "nothing": "nothing seen",
}
STALLS_NAMED = 3
"""The longest stalls the note names."""


def stalls_table(spans: Sequence[Span], index: SpanIndex, th: Thresholds) -> Table:
    """Each stream's longest gap between token events, if at least `min_stall_s`, by the span that
    was computed for most of it (from its compute start to its first token, or its end)."""
    groups: dict[str, list[float]] = {key: [] for key in STALL_LABELS}
    stalls: list[tuple[Span, Span | None]] = []
    undated = 0
    for s in spans:
        if s.longest_gap_s is None or s.longest_gap_s < th.min_stall_s:
            continue
        if s.longest_gap_start is None:
            undated += 1  # written before `gap_max_at_ms`: when it froze is unknown
            continue
        computed = computed_during_gap(s, index)
        groups[_stall_kind(computed)].append(s.longest_gap_s)
        stalls.append((s, computed))
    rows = [Row(label, len(groups[k]), (sum(groups[k]), max(groups[k], default=None)))
            for k, label in STALL_LABELS.items()]
    every = [gap for values in groups.values() for gap in values]
    rows.append(Row("in all", len(every), (sum(every), max(every, default=None))))
    notes = [_longest_stalls(stalls)] if stalls else []
    if undated:
        notes.append(f"left out: {undated} stream(s) with a gap of {th.min_stall_s:g} s or more "
                     "whose record has no gap_max_at_ms (written by an older slotwise)")
    return Table(
        "stalls",
        f"Streams' stalls of {th.min_stall_s:g} s or more, by what was computed meanwhile",
        ("total", "max"),
        ("s", "s"),
        tuple(rows),
        note="; ".join(notes),
    )


def computed_during_gap(stream: Span, index: SpanIndex) -> Span | None:
    """The other span whose computing (`compute_start` to `compute_end`) covered most of the
    stream's longest gap; None if none covered any of it."""
    if stream.longest_gap_start is None or stream.longest_gap_s is None:
        return None
    g0, g1 = stream.longest_gap_start, stream.longest_gap_start + stream.longest_gap_s
    found, most = None, 0.0
    for other in index.active(g0, g1, stream.key):
        shared = overlap(g0, g1, other.compute_start, other.compute_end)
        if shared > most:
            found, most = other, shared
    return found


def _stall_kind(computed: Span | None) -> str:
    if computed is None:
        return "nothing"
    if computed.kind == Kind.WARM:
        return "warm"
    if computed.kind in (Kind.KV_SAVE, Kind.KV_RESTORE):
        return "kv"
    return "pieces" if computed.pieces else "whole"


def _longest_stalls(stalls: Sequence[tuple[Span, Span | None]]) -> str:
    """The longest stalls: whose stream (its client and id), how long, and the id of what
    computed."""
    ranked = sorted(stalls, key=lambda pair: (-(pair[0].longest_gap_s or 0.0), pair[0].start))
    named = [f"{_who(stream)} {fmt(stream.longest_gap_s, 's')} "
             + (f"while {computed.key} was computed" if computed else "with nothing seen")
             for stream, computed in ranked[:STALLS_NAMED]]
    return "longest: " + ", ".join(named)


def _who(stream: Span) -> str:
    return stream.key if stream.client is None else f"{stream.client} ({stream.key})"
