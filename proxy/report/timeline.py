"""Lays spans out for a timeline picture: lanes, phase bars and stall marks, all pure.

Server tasks keep their slot as lane; timing records (no slot ids) get lanes greedily so that
overlapping requests never share one. Times are seconds from the first span.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.report.model import Span

PHASES = ("wait", "fed in pieces", "prefill", "long prefill", "decode", "unknown")


@dataclass(frozen=True)
class Bar:
    lane: int
    start: float
    end: float
    phase: str
    key: str
    info: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Mark:
    """A decode stretch whose rate fell below the stall threshold."""

    lane: int
    start: float
    end: float
    rate: float
    why: str


@dataclass(frozen=True)
class Timeline:
    t0: float
    duration: float
    lanes: int
    lane_names: tuple[str, ...]
    bars: tuple[Bar, ...]
    marks: tuple[Mark, ...]
    stall_rate: float | None


def assign_lanes(spans: Sequence[Span]) -> dict[str, int]:
    if spans and all(s.slot is not None for s in spans):
        return {s.key: s.slot or 0 for s in spans}
    lanes: list[float] = []
    result: dict[str, int] = {}
    for span in sorted(spans, key=lambda s: s.start):
        free = next((i for i, end in enumerate(lanes) if end <= span.start), None)
        if free is None:
            free = len(lanes)
            lanes.append(span.end)
        lanes[free] = span.end
        result[span.key] = free
    return result


def typical_decode_rate(spans: Sequence[Span]) -> float | None:
    rates = [
        s.predicted_n / (s.predicted_ms / 1000)
        for s in spans
        if s.predicted_n and s.predicted_ms and s.predicted_n > 1
    ]
    return statistics.median(rates) if rates else None


def layout(spans: Sequence[Span], big_new: int = 5000, stall_fraction: float = 0.25) -> Timeline:
    if not spans:
        return Timeline(0.0, 0.0, 0, (), (), (), None)
    t0 = min(s.start for s in spans)
    lanes = assign_lanes(spans)
    typical = typical_decode_rate(spans)
    stall = typical * stall_fraction if typical else None
    bars: list[Bar] = []
    marks: list[Mark] = []
    for s in spans:
        lane = lanes[s.key]
        bars += [
            Bar(lane, a - t0, b - t0, phase, s.key, s.info) for a, b, phase in _phases(s, big_new) if b > a
        ]
        if stall is not None:
            marks += [
                Mark(lane, g.start - t0, g.end - t0, g.rate, g.why)
                for g in s.segments
                if g.rate < stall and g.end > g.start
            ]
    n_lanes = max(lanes.values()) + 1
    slotted = all(s.slot is not None for s in spans)
    names = tuple(f"slot {i}" if slotted else f"lane {i}" for i in range(n_lanes))
    duration = max(s.end for s in spans) - t0
    return Timeline(t0, duration, n_lanes, names, tuple(bars), tuple(marks), stall)


def _phases(s: Span, big_new: int) -> list[tuple[float, float, str]]:
    if s.prefill_start is None or s.first_token is None:
        return [(s.start, s.end, "unknown")]
    prefill = "long prefill" if (s.new_n or 0) >= big_new else "prefill"
    # A request fed in pieces (chunk mode) waits in slotwise while its prompt is computed.
    fed_from = s.first_piece if s.pieces and s.first_piece is not None else s.prefill_start
    fed_from = min(max(fed_from, s.start), s.prefill_start)
    return [
        (s.start, fed_from, "wait"),
        (fed_from, s.prefill_start, "fed in pieces"),
        (s.prefill_start, s.first_token, prefill),
        (s.first_token, s.end, "decode"),
    ]
