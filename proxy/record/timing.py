"""The clock readings of one request and the figures made from them (gaps and when the longest
began, worst 3-second rate).

Pure: every method takes the time as an argument, so tests step time with plain numbers. The record
itself (the JSON line) is assembled in `record.py`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 3.0  # the worst-rate window, as llama-server's own `tg_3s`


@dataclass
class RequestTimer:
    """Times (monotonic seconds) of the moments of one request's life."""

    arrived: float
    sent: float | None = None  # request sent upstream
    headers: float | None = None  # upstream response headers received
    prefill_started: float | None = None
    prefill_done: float | None = None  # last progress chunk (processed == total) or first token
    tokens: list[float] = field(default_factory=list)  # arrival time of every token event
    ended: float | None = None
    progress_seen: bool = False

    def on_sent(self, now: float) -> None:
        self.sent = now

    def on_headers(self, now: float, *, prefill_starts: bool) -> None:
        """Headers came; for a stream llama-server sends them when the slot starts its prefill."""
        self.headers = now
        if prefill_starts and self.prefill_started is None:
            self.prefill_started = now

    def on_progress(self, now: float, progress: dict[str, Any]) -> None:
        self.progress_seen = True
        if self.prefill_started is None:
            self.prefill_started = now
        total, processed = progress.get("total"), progress.get("processed")
        if isinstance(total, int) and total == processed:
            self.prefill_done = now

    def on_token(self, now: float) -> None:
        if not self.tokens and self.prefill_done is None:
            self.prefill_done = now
        self.tokens.append(now)

    def on_end(self, now: float) -> None:
        if self.ended is None:
            self.ended = now

    def ms(self, start: float | None, end: float | None) -> float | None:
        if start is None or end is None:
            return None
        return round((end - start) * 1000.0, 1)

    def figures(self) -> dict[str, Any]:
        """The record's timing fields that come from this clock."""
        first = self.tokens[0] if self.tokens else None
        last = self.tokens[-1] if self.tokens else None
        gaps = gap_figures(self.tokens, self.arrived)
        return {
            "proxy_ms": self.ms(self.arrived, self.sent),
            "queue_ms": self.ms(self.sent, self.headers),
            "prefill_ms": self.ms(self.prefill_started, self.prefill_done),
            "ttft_ms": self.ms(self.arrived, first),
            "decode_ms": self.ms(first, last),
            "total_ms": self.ms(self.arrived, self.ended) or 0.0,
            "events": len(self.tokens),
            **gaps,
            "worst_3s_rate": worst_window_rate(self.tokens),
        }


def gap_figures(times: Sequence[float], arrived: float) -> dict[str, float | None]:
    """p50, p95 and max of the gaps between consecutive events, in ms, and when the longest gap
    began (the earliest of equals), in ms after `arrived`."""
    pairs = list(itertools.pairwise(times))
    if not pairs:
        return {"gap_p50_ms": None, "gap_p95_ms": None, "gap_max_ms": None, "gap_max_at_ms": None}
    gaps = sorted(b - a for a, b in pairs)
    longest_from = max(pairs, key=lambda pair: pair[1] - pair[0])[0]
    return {
        "gap_p50_ms": round(percentile(gaps, 50) * 1000.0, 1),
        "gap_p95_ms": round(percentile(gaps, 95) * 1000.0, 1),
        "gap_max_ms": round(gaps[-1] * 1000.0, 1),
        "gap_max_at_ms": round((longest_from - arrived) * 1000.0, 1),
    }


def percentile(ordered: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty sequence."""
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


def worst_window_rate(times: Sequence[float], window: float = WINDOW_S) -> float | None:
    """The lowest event rate (per second) over any `window`-long stretch of the decode.

    The stretch slides over [first, last]; its emptiest position starts at the first event or just
    after one, so it is enough to try those positions. None if the decode is shorter than `window`.
    """
    if len(times) < 2 or times[-1] - times[0] < window:
        return None
    fewest = bisect.bisect_left(times, times[0] + window)  # events in [first, first + window)
    for i, start in enumerate(times):
        if start + window > times[-1]:
            break
        fewest = min(fewest, bisect.bisect_right(times, start + window) - i - 1)  # (start, +window]
    return round(fewest / window, 2)
