"""A time index over spans: which spans were active in a window, which ran alone.

Used by the aggregation of both commands, so contention is judged the same way for records and
for server tasks.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from proxy.report.model import Span


class SpanIndex:
    def __init__(self, spans: Sequence[Span]) -> None:
        self.spans = sorted(spans, key=lambda s: s.start)
        self._starts = [s.start for s in self.spans]
        self._longest = max((s.total_s for s in self.spans), default=0.0)
        self.by_key = {s.key: s for s in self.spans}

    def active(self, t0: float, t1: float, exclude: str | None = None) -> Iterator[Span]:
        """Spans whose life intersects the open window (t0, t1), except `exclude`."""
        hi = bisect.bisect_left(self._starts, t1)
        lo = bisect.bisect_left(self._starts, t0 - self._longest)
        for span in self.spans[lo:hi]:
            if span.end > t0 and span.key != exclude:
                yield span

    def running_at_start(self, span: Span) -> list[Span]:
        """Spans in flight when `span` arrived: from its record if known, else from the time axis."""
        if span.running_at_start is not None:
            return [self.by_key[k] for k in span.running_at_start if k in self.by_key]
        end = span.prefill_start if span.prefill_start is not None else span.start
        return list(self.active(span.start, max(end, span.start + 1e-6), span.key))

    def alone(self) -> set[str]:
        """Keys of spans no other span overlapped."""
        result: set[str] = set()
        max_end = float("-inf")
        for i, span in enumerate(self.spans):
            after = self.spans[i + 1].start if i + 1 < len(self.spans) else float("inf")
            if max_end <= span.start and after >= span.end:
                result.add(span.key)
            max_end = max(max_end, span.end)
        return result

    def busy_seconds(self, at_least: int = 2) -> float:
        """Seconds during which at least `at_least` spans were active."""
        edges = sorted([(s.start, 1) for s in self.spans] + [(s.end, -1) for s in self.spans])
        total, level, last = 0.0, 0, 0.0
        for t, step in edges:
            if level >= at_least:
                total += t - last
            level += step
            last = t
        return total
