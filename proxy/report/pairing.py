"""Pairs llama-server tasks with slotwise's timing records by time and token counts.

The server log's clock starts at 0 when the server started; records carry wall-clock times. The
offset between the two is the median over pairs whose token counts are unique on both sides.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Sequence

from proxy.report.model import Span
from proxy.report.records import RecordLine, record_to_span, timing
from proxy.report.tasks import Task, task_to_span

TOLERANCE_S = 2.0


def _tokens(record: RecordLine) -> tuple[int, int] | None:
    p, g = timing(record, "prompt_n"), timing(record, "predicted_n")
    return None if p is None or g is None else (int(p), int(g))


def clock_offset(tasks: Sequence[Task], records: Sequence[RecordLine]) -> float | None:
    """Wall-clock seconds minus log seconds, or None when nothing pairs unambiguously."""
    by_tokens = {(t.prompt_n, t.predicted_n): t for t in tasks if t.prefill_start_s is not None}
    task_counts = Counter((t.prompt_n, t.predicted_n) for t in tasks)
    rec_counts = Counter(_tokens(r) for r in records)
    offsets = []
    for record in records:
        key = _tokens(record)
        span = record_to_span(record)
        if key is None or span.prefill_start is None or rec_counts[key] != 1:
            continue
        task = by_tokens.get(key)
        if task is not None and task_counts[key] == 1 and task.prefill_start_s is not None:
            offsets.append(span.prefill_start - task.prefill_start_s)
    return statistics.median(offsets) if offsets else None


def pair(tasks: Sequence[Task], records: Sequence[RecordLine]) -> tuple[list[Span], int, float | None]:
    """Task spans, those paired carrying the record's arrival, client, purpose and LoRA; also the
    number paired and the clock offset."""
    offset = clock_offset(tasks, records)
    spans = {t.key: s for t in tasks if (s := task_to_span(t)) is not None}
    if offset is None:
        return list(spans.values()), 0, None
    free = {t.key: t for t in tasks if t.key in spans and t.prefill_start_s is not None}
    paired = 0
    for record in records:
        key, rspan = _tokens(record), record_to_span(record)
        if key is None or rspan.prefill_start is None:
            continue
        target = rspan.prefill_start - offset
        best = min(
            (
                t
                for t in free.values()
                if (t.prompt_n, t.predicted_n) == key
                and abs((t.prefill_start_s or 0.0) - target) <= TOLERANCE_S
            ),
            key=lambda t: abs((t.prefill_start_s or 0.0) - target),
            default=None,
        )
        if best is None:
            continue
        del free[best.key]
        paired += 1
        spans[best.key] = dataclasses.replace(
            spans[best.key],
            start=min(rspan.start - offset, spans[best.key].start),
            client=rspan.client,
            purpose=rspan.purpose,
            lora=rspan.lora,
            info=(
                *spans[best.key].info,
                ("request", rspan.key),
                ("queue_wait_s", f"{(rspan.wait_s or 0.0):.3f}"),
            ),
        )
    return list(spans.values()), paired, offset
