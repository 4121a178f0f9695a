"""Rebuilds each server task on the time axis from the parsed log events.

A task runs from `launch_slot_` to `release`; the end timings place its prefill and decode:
decode ends at the timings line, starts `eval time` before, and the prefill `prompt eval time` before
that. What remains between launch and prefill is the wait inside the slot.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.report.model import Segment, Span
from proxy.report.serverlog import Event


@dataclass
class Task:
    run: int
    slot: int
    task: int
    start_s: float
    seen_start: bool = True
    """False when the log began after this task had started."""
    selected_by: str | None = None
    selected_s: float | None = None
    """When llama-server chose the slot; until `start_s` it may copy prompts to and from its RAM
    cache, on its main loop, while every other slot waits."""
    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None
    total_ms: float | None = None
    timings_s: float | None = None
    end_s: float | None = None
    n_tokens: int | None = None
    cancelled: bool = False
    error: str | None = None
    progress: list[tuple[float, int]] = field(default_factory=list)
    tg: list[tuple[float, int, float]] = field(default_factory=list)
    """(time, n_gen, tg_3s) of each generation progress line."""

    @property
    def key(self) -> str:
        return f"task {self.task}" if self.run == 1 else f"task {self.run}:{self.task}"

    @property
    def decode_start_s(self) -> float | None:
        end = self.timings_s if self.timings_s is not None else self.end_s
        if end is None or self.predicted_ms is None:
            return None
        return end - self.predicted_ms / 1000

    @property
    def prefill_start_s(self) -> float | None:
        decode = self.decode_start_s
        return None if decode is None or self.prompt_ms is None else decode - self.prompt_ms / 1000

    @property
    def slot_switch_ms(self) -> float | None:
        """From choosing the slot to starting the task (the RAM prompt cache's save/restore)."""
        return None if self.selected_s is None else (self.start_s - self.selected_s) * 1000.0

    @property
    def cache_n(self) -> int | None:
        """Prompt tokens reused: the slot's tokens at release minus those computed in this task."""
        if self.n_tokens is None or self.prompt_n is None or self.predicted_n is None:
            return None
        return max(0, self.n_tokens - self.prompt_n - max(0, self.predicted_n - 1))

    def to_json(self) -> dict[str, Any]:
        wait = None if self.prefill_start_s is None else max(0.0, self.prefill_start_s - self.start_s)
        return {
            "slot": self.slot,
            "task": self.task,
            "run": self.run,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "prefill_start_s": self.prefill_start_s,
            "decode_start_s": self.decode_start_s,
            "wait_s": wait,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "total_ms": self.total_ms,
            "n_tokens_at_release": self.n_tokens,
            "cache_n_estimate": self.cache_n,
            "selected_by": self.selected_by,
            "slot_switch_ms": self.slot_switch_ms,
            "seen_start": self.seen_start,
            "cancelled": self.cancelled,
            "error": self.error,
            "tg_3s": [{"t": t, "n_gen": n, "tg_3s": r} for t, n, r in self.tg],
        }


def rebuild_tasks(events: Iterable[Event]) -> list[Task]:
    tasks: dict[tuple[int, int], Task] = {}
    selected: dict[tuple[int, int], tuple[str, float]] = {}
    for ev in events:
        if ev.kind == "selected":
            selected[(ev.run, ev.slot)] = (ev.values[0], ev.t)
            continue
        if ev.kind == "launch":
            by, at = selected.pop((ev.run, ev.slot), (None, None))
            tasks[(ev.run, ev.task)] = Task(ev.run, ev.slot, ev.task, ev.t, selected_by=by,
                                            selected_s=at)
            continue
        task = tasks.get((ev.run, ev.task))
        if task is None:
            if ev.slot < 0:
                continue  # a cancel or error for a task this log never showed
            task = tasks[(ev.run, ev.task)] = Task(ev.run, ev.slot, ev.task, ev.t, seen_start=False)
        _apply(task, ev)
    return sorted(tasks.values(), key=lambda t: (t.run, t.start_s))


def _apply(task: Task, ev: Event) -> None:
    v = ev.values
    if ev.kind == "pp_progress":
        task.progress.append((ev.t, int(v[0])))
    elif ev.kind == "tg_progress":
        task.tg.append((ev.t, int(v[0]), float(v[2])))
    elif ev.kind == "prompt_eval":
        task.prompt_ms, task.prompt_n, task.timings_s = float(v[0]), int(v[1]), ev.t
    elif ev.kind == "eval":
        task.predicted_ms, task.predicted_n = float(v[0]), int(v[1])
    elif ev.kind == "total":
        task.total_ms = float(v[0])
    elif ev.kind == "release":
        task.end_s, task.n_tokens = ev.t, int(v[0])
    elif ev.kind == "cancel":
        task.cancelled = True
    elif ev.kind == "error":
        task.error = v[0] if v else "error"


def task_to_span(task: Task) -> Span | None:
    """The task on the time axis; None while it has no end in the log."""
    if task.end_s is None:
        return None
    decode = task.decode_start_s
    return Span(
        key=task.key,
        start=task.start_s,
        end=task.end_s,
        prefill_start=task.prefill_start_s,
        first_token=decode,
        prompt_n=task.prompt_n,
        cache_n=task.cache_n,
        predicted_n=task.predicted_n,
        prompt_ms=task.prompt_ms,
        predicted_ms=task.predicted_ms,
        slot=task.slot,
        lora=None,
        segments=tuple(tg_segments(task)),
        info=tuple((k, str(v)) for k, v in task.to_json().items() if v is not None and k != "tg_3s"),
    )


def tg_segments(task: Task) -> Iterable[Segment]:
    """Each tg_3s figure covers the time since the previous progress line (or the first token)."""
    previous = task.decode_start_s
    for t, _n, rate in task.tg:
        if previous is not None and t > previous:
            yield Segment(previous, t, rate, "tg_3s")
        previous = t
