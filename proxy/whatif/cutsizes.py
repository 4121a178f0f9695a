"""The sizes of requests whose client left before llama-server said them (a stream cut mid-prompt
or mid-reply: its record has no timings), from the server log's own lines for the task that ran
it: a prompt-progress line gives the tokens computed and the share of the prompt in the slot
(`progress = (cached + computed) / prompt`), a slot chosen by prompt similarity the share of the
prompt it held (`f_sim_best`) and the share of the slot's tokens that was (`f_keep`). Pure.

A task is the record's when it is the first one launched after the record's arrival (the logs'
clocks set apart by a request both show, found by its sizes) that never printed its timings.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from proxy.report.records import RecordLine, num, start_of, timing
from proxy.report.serverlog import Event
from proxy.report.tasks import Task

_SIMILAR = re.compile(r"selected slot by LCP similarity, f_sim_best = ([\d.]+) .*f_keep = ([\d.]+)")
LAUNCH_SLACK_S = 1.0
"""A task launched this long before the record's arrival still counts (the clocks' offset)."""


@dataclass(frozen=True)
class Seen:
    """What the server log says of one task's prompt, where it says it."""

    progress: tuple[int, float] | None = None
    """The last prompt-progress line: tokens computed, share of the prompt in the slot."""
    similar: tuple[float, float] | None = None
    """The slot chosen by similarity: (f_sim_best, f_keep)."""


def seen_by_task(events: Iterable[Event], lines: Iterable[str]) -> dict[tuple[int, int], Seen]:
    """(run, task) → what its lines say; the similarity lines are the `selected` events by LCP
    similarity, in the same order."""
    similar = [(float(m.group(1)), float(m.group(2))) for line in lines
               if (m := _SIMILAR.search(line)) is not None]
    out: dict[tuple[int, int], Seen] = {}
    pending: dict[tuple[int, int], tuple[float, float]] = {}
    for ev in events:
        if ev.kind == "selected" and ev.values[0] == "LCP similarity" and similar:
            pending[(ev.run, ev.slot)] = similar.pop(0)
        elif ev.kind == "launch" and (ev.run, ev.slot) in pending:
            out[(ev.run, ev.task)] = Seen(similar=pending.pop((ev.run, ev.slot)))
        elif ev.kind == "pp_progress":
            key = (ev.run, ev.task)
            old = out.get(key, Seen())
            out[key] = Seen((int(ev.values[0]), float(ev.values[1])), old.similar)
    return out


def cut_sizes(tasks: Sequence[Task], records: Sequence[RecordLine],
              seen: Mapping[tuple[int, int], Seen]) -> dict[str, tuple[int, int]]:
    """Record id → (prompt tokens, cached tokens) for each record without timings whose task the
    server log shows with enough lines to tell."""
    offset = log_offset(tasks, records)
    if offset is None:
        return {}
    untimed = [t for t in tasks if t.prompt_ms is None]
    claimed: set[int] = set()
    sizes: dict[str, tuple[int, int]] = {}
    for record in sorted(records, key=start_of):
        total = num(record, "total_ms")
        if record.get("timings") or total is None or record.get("outcome") != "client_gone":
            continue
        arrived = start_of(record) + offset
        task = next((t for t in untimed if id(t) not in claimed
                     and arrived - LAUNCH_SLACK_S <= t.start_s <= arrived + total / 1000.0), None)
        if task is None:
            continue
        claimed.add(id(task))
        size = _size(task, tasks, seen.get((task.run, task.task), Seen()))
        if size is not None:
            sizes[str(record.get("id"))] = size
    return sizes


def _size(task: Task, tasks: Sequence[Task], seen: Seen) -> tuple[int, int] | None:
    cached = None
    if seen.similar is not None:
        before = [t for t in tasks if t.slot == task.slot and t.run == task.run
                  and t.end_s is not None and t.end_s <= task.start_s and t.n_tokens]
        if before:
            f_sim, f_keep = seen.similar
            cached = round(f_keep * (before[-1].n_tokens or 0))
            if seen.progress is None and f_sim > 0:
                return max(cached + 1, round(cached / f_sim)), cached
    if seen.progress is None:
        return None
    computed, share = seen.progress
    cached = cached or 0
    prompt = round((cached + computed) / share) if share > 0 else cached + computed
    return max(prompt, cached + computed), cached


def log_offset(tasks: Sequence[Task], records: Sequence[RecordLine]) -> float | None:
    """Server-log time minus record time: the least of (launch − arrival) over the requests both
    show, found by their sizes (a task launches at its arrival at the soonest)."""
    by_size = tasks_by_size(tasks)
    gaps = []
    for record in records:
        found = by_size.get(record_size(record) or (-1, -1), [])
        if len(found) == 1:
            gaps.append(found[0].start_s - start_of(record))
    return min(gaps, default=None)


def tasks_by_size(tasks: Sequence[Task]) -> dict[tuple[int, int], list[Task]]:
    """The tasks with timings by their (prompt_n, predicted_n), in the log's order."""
    out: dict[tuple[int, int], list[Task]] = {}
    for t in tasks:
        if t.prompt_n is not None and t.predicted_n is not None:
            out.setdefault((t.prompt_n, t.predicted_n), []).append(t)
    return out


def record_size(record: RecordLine) -> tuple[int, int] | None:
    """A record's (prompt_n, predicted_n), the sizes a task of it shows; None without timings."""
    prompt_n, predicted_n = timing(record, "prompt_n"), timing(record, "predicted_n")
    if prompt_n is None or predicted_n is None:
        return None
    return int(prompt_n), int(predicted_n)
