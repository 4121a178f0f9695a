"""Aggregation that only llama-server's log allows: tg_3s against other slots' prefills, prefill
speed by step size, slot switches that stall the server, and the accounting of every log line.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from proxy.report.model import Row, Table, overlap, quantile
from proxy.report.serverlog import ParsedLog
from proxy.report.tasks import Task, tg_segments


def tg3s_table(tasks: Sequence[Task], long_prefill: int) -> Table:
    """tg_3s samples by how much of their window lay inside another slot's prefill of >= N."""
    prefills = [
        (t.key, t.prefill_start_s, t.decode_start_s)
        for t in tasks
        if (t.prompt_n or 0) >= long_prefill and t.prefill_start_s is not None
    ]
    groups: dict[str, list[float]] = defaultdict(list)
    for task in tasks:
        for seg in tg_segments(task):
            inside = sum(
                overlap(seg.start, seg.end, a, b)
                for key, a, b in prefills
                if key != task.key and a is not None and b is not None
            )
            share = inside / (seg.end - seg.start)
            groups["during" if share >= 0.9 else "otherwise" if share <= 0.1 else "partly"].append(seg.rate)
    labels = {
        "during": f"while another slot prefilled >= {long_prefill:,} tokens",
        "otherwise": "otherwise",
        "partly": "window partly inside such a prefill",
    }
    rows = tuple(
        Row(label, len(groups[k]), (quantile(groups[k], 0.5), min(groups[k], default=None)))
        for k, label in labels.items()
    )
    return Table(
        "decode_rate",
        "Decode rate: tg_3s samples (tokens per second)",
        ("median", "min"),
        ("tok/s", "tok/s"),
        rows,
        note="a sample's window is the time since the slot's previous n_gen line; 'while' means "
        ">= 90% of it inside the prefill, 'otherwise' <= 10%",
        n_label="samples",
    )


STEP_BUCKETS = (
    (1500, "1,500 or more"),
    (600, "600-1,500"),
    (256, "256-600"),
    (64, "64-256"),
    (0, "under 64"),
)


def prefill_steps_table(tasks: Sequence[Task]) -> Table:
    """Prefill speed by tokens per step, from consecutive `prompt processing` lines."""
    groups: dict[str, list[float]] = defaultdict(list)
    for task in tasks:
        for (t0, n0), (t1, n1) in zip(task.progress, task.progress[1:], strict=False):
            if t1 > t0 and n1 > n0:
                label = next(lbl for low, lbl in STEP_BUCKETS if n1 - n0 >= low)
                groups[label].append((n1 - n0) / (t1 - t0))
    rows = tuple(
        Row(label, len(groups[label]), (quantile(groups[label], 0.5),))
        for _low, label in STEP_BUCKETS
        if groups[label]
    )
    return Table(
        "prefill_steps",
        "Prefill speed by tokens per step (progress lines)",
        ("median",),
        ("tok/s",),
        rows,
        n_label="steps",
        note="" if rows else "no consecutive 'prompt processing' lines (prompts under 3 s)",
    )


SLOW_SWITCH_MS = 20.0
"""A slot switch this long is a RAM-cache copy, not bookkeeping (an empty slot takes < 1 ms)."""


def slot_switch_table(tasks: Sequence[Task]) -> Table:
    """Time from choosing a slot to starting the task, by how the slot was chosen."""
    groups: dict[str, list[float]] = defaultdict(list)
    for task in tasks:
        if task.slot_switch_ms is not None:
            groups[task.selected_by or "?"].append(task.slot_switch_ms)
    rows = []
    for method, gaps in sorted(groups.items()):
        slow = [g for g in gaps if g >= SLOW_SWITCH_MS]
        rows.append(Row(f"selected by {method}", len(gaps),
                        (len(slow), quantile(slow, 0.5), max(gaps), sum(slow) / 1000.0)))
    return Table(
        "slot_switches",
        "Slot switches: choosing a slot to starting the task",
        (f">= {SLOW_SWITCH_MS:.0f} ms", "median of those", "max", "total of those"),
        ("", "ms", "ms", "s"),
        tuple(rows),
        n_label="tasks",
        note="llama-server copies the slot's previous prompt to its RAM cache (and a cached one "
        "back) before the task starts, on its main loop: every generating slot waits meanwhile. "
        "Many slow switches: more slots (-np), or --cache-ram 0 if returning prompts are rare"
        if rows else "no 'selected slot' lines in this log",
    )


def lines_table(log: ParsedLog, tasks: Sequence[Task]) -> Table:
    rows = [Row(name, count, ()) for name, count in sorted(log.counts.items())]
    rows += [
        Row("tasks", len(tasks), ()),
        Row("tasks finished", sum(1 for t in tasks if t.end_s is not None), ()),
        Row("tasks still running at the end of the log", sum(1 for t in tasks if t.end_s is None), ()),
        Row("tasks begun before the log", sum(1 for t in tasks if not t.seen_start), ()),
        Row("tasks cancelled", sum(1 for t in tasks if t.cancelled), ()),
        Row("server runs (restarts + 1)", log.runs, ()),
    ]
    return Table("lines", f"Log lines ({log.lines}) and tasks", (), (), tuple(rows), n_label="count")
