"""Cost observations from llama-server's own log, which times the batches themselves: each task's
prompt time (`prompt eval time`), each step between two prompt-progress lines, and the decode steps
between two generation-progress lines (`n_gen`). Its times hold no HTTP, tokenising or queueing,
so short prompts count too. Pure: rebuilt tasks in, observations out.

A prompt or a step counts when no other task computed prompt tokens beside it (their batches would
be in its time); a decode window counts when no task started or stopped generating in it (a task
of one token, a piece or a warm-up, does not), with the prompts computed in it taken out: their
time in it and one step per batch of theirs, in which each decode token rode (a day fed in pieces
has few windows with no piece in them), when half its time and `MIN_WINDOW_STEPS` steps are
left. Each is priced against the decoding slots beside it and the cells those attend to
(their own: the prompt, what was cached and what they generated) and, with one shared KV,
against the cells of the KV's span read beyond their own (kvcells.py, its cells placed again
from the tasks' launches, prompts and replies).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.report.records import RecordLine, start_of, timing
from proxy.report.tasks import Task
from proxy.whatif.kvcells import KvCells
from proxy.whatif.observe import DecodeObs, PrefillObs, prompt_obs, union_s
from proxy.whatif.settings import ServerSettings

MIN_TASK_PROMPT = 16
"""A task's prompt shorter than this is too close to a decode step to tell the batch costs apart."""
MIN_WINDOW_STEPS = 8
STARVED_FACTOR = 20.0
"""A prompt that took this many times the log's median time a prompt token waited, not computed
(`_starved`)."""
GEN_CELLS = 16
"""Generated tokens placed at a time when the KV's cells are placed again (their times spread
evenly over the reply)."""


def _prefill(task: Task) -> tuple[float, float] | None:
    """When the task computed prompt tokens; a task with no timings (cancelled, cut off) is taken
    to have computed them from its launch to its end."""
    start, first = task.prefill_start_s, task.decode_start_s
    if start is not None and first is not None:
        return start, first
    end = task.end_s if task.end_s is not None else task.start_s
    return (task.start_s, max(end, task.progress[-1][0] if task.progress else end))


def _cells(task: Task, t: float) -> float:
    """The cells a generating task's slot holds at `t`."""
    first = task.decode_start_s
    held = (task.cache_n or 0) + (task.prompt_n or 0)
    if first is None or not task.predicted_ms or not task.predicted_n or t <= first:
        return float(held)
    return held + min(1.0, (t - first) / (task.predicted_ms / 1000.0)) * task.predicted_n


def _held(task: Task, t: float) -> float:
    """The cells a task's slot holds at `t`: what was cached, the prompt computed so far (evenly
    over its prefill), what it generated."""
    start, first = task.prefill_start_s, task.decode_start_s
    if start is None or first is None or t < task.start_s or (task.end_s or t) < t:
        return 0.0
    cached = float(task.cache_n or 0)
    if t < start:
        return cached
    if t < first:
        return cached + (task.prompt_n or 0) * (t - start) / max(1e-9, first - start)
    return _cells(task, t)


def _starved(tasks: Sequence[Task]) -> dict[int, float]:
    """Tasks whose prompt waited far longer than computing it takes (`STARVED_FACTOR` × the
    log's median time a prompt token): a request with other LoRA settings in a slot whose tokens
    no batch took until the others were done (`bench day`'s `cho-0` with `-b 512`: 573 tokens in
    264 s). By id, the time (s) its prompt is taken to have computed: at that median rate, just
    before its first token. Taken at its whole wait, it would keep every decode window and every
    other prompt of the day out of the calibration."""
    rates = sorted(t.prompt_ms / t.prompt_n for t in tasks
                   if t.prompt_n and t.prompt_n >= MIN_TASK_PROMPT and t.prompt_ms)
    if not rates:
        return {}
    per_token_ms = rates[(len(rates) - 1) // 2]  # the lower median
    return {id(t): t.prompt_n * per_token_ms / 1000.0 for t in tasks
            if t.prompt_n and t.prompt_ms
            and t.prompt_ms > STARVED_FACTOR * t.prompt_n * per_token_ms}


class _Day:
    def __init__(self, tasks: Sequence[Task], server: ServerSettings | None = None) -> None:
        self.tasks = tasks
        self.span = kv_span(tasks, server) if server is not None and server.kv_unified else None
        self.starved = _starved(tasks)
        self.prefills = [(t, self._computing(t, p)) for t in tasks if (p := _prefill(t)) is not None]
        self.gen = [t for t in tasks if t.decode_start_s is not None and t.end_s is not None]
        self.streams = [t for t in self.gen if (t.predicted_n or 0) >= 2]

    def _computing(self, task: Task, span: tuple[float, float]) -> tuple[float, float]:
        """When the task computed its prompt: a starved one's only its last stretch."""
        took = self.starved.get(id(task))
        return span if took is None else (max(span[0], span[1] - took), span[1])

    def prompt_beside(self, task: Task | None, t0: float, t1: float) -> bool:
        return any(o is not task and a < t1 and b > t0 for o, (a, b) in self.prefills)

    def decoding(self, task: Task | None, t0: float, t1: float) -> list[Task]:
        """Tasks generating through the whole of (t0, t1)."""
        return [o for o in self.gen if o is not task and (o.decode_start_s or 0) <= t0
                and (o.end_s or 0) >= t1]

    def others(self, task: Task, t: float) -> float:
        """Thousands of cells of the shared KV's span at `t` beyond the task's own (kv_span);
        without the server's settings, the cells the other tasks' slots hold."""
        if self.span is not None:
            return max(0.0, self.span(t) - _held(task, t)) / 1000.0
        return sum(_held(o, t) for o in self.tasks if o is not task) / 1000.0

    def generating(self, t0: float, t1: float) -> list[tuple[Task, float, float]]:
        """Each task generating in (t0, t1), the share of it it generated and the middle of that
        stretch."""
        out = []
        for o in self.streams:
            a, b = max(t0, o.decode_start_s or 0.0), min(t1, o.end_s or 0.0)
            if b > a:
                out.append((o, (b - a) / (t1 - t0), (a + b) / 2))
        return out

    def changes(self, t0: float, t1: float) -> bool:
        """A task started or stopped generating inside (t0, t1)."""
        return any(t0 < (o.decode_start_s or 0) < t1 or t0 < (o.end_s or 0) < t1
                   for o in self.streams)

    def decode_apart(self, t0: float, t1: float, steps: int, n_batch: int
                     ) -> tuple[int, float] | None:
        """The decode-only steps of (t0, t1) and their time: the prompts computed in it taken out
        (the union of their time, one step per batch of theirs); None when under half the time or
        `MIN_WINDOW_STEPS` steps are left."""
        spans, batches = [], 0
        for task, (a, b) in self.prefills:
            if b <= t0 or a >= t1 or b <= a:
                continue
            lo, hi = max(a, t0), min(b, t1)
            spans.append((lo, hi))
            share = (task.prompt_n or 0) * (hi - lo) / (b - a)
            batches += max(1, math.ceil(share / max(1, n_batch)))
        left_ms = (t1 - t0 - union_s(spans)) * 1000.0
        left = steps - batches
        if left < MIN_WINDOW_STEPS or left_ms < 0.5 * (t1 - t0) * 1000.0:
            return None
        return left, left_ms


@dataclass(frozen=True)
class ServerObs:
    """What one log's batches show (`server_obs`)."""

    prefills: list[PrefillObs]
    """Each task's prompt (`task_prefill_obs`)."""
    steps: list[PrefillObs]
    """Each prompt-progress step."""
    decodes: list[DecodeObs]
    """Each decode window in which nothing started or stopped generating (`decode_obs`)."""
    shared_decodes: list[DecodeObs]
    """Each window of every reply (`decode_obs(shared=True)`)."""
    span: Callable[[float], int] | None
    """One shared KV's span through it (`kv_span`: its cells placed once; None with a KV per slot)."""


def server_obs(tasks: Sequence[Task], server: ServerSettings) -> ServerObs:
    """Everything one log's batches show, its tasks read once."""
    day = _Day(tasks, server)
    return ServerObs(_task_prefill(day, server), _progress(day, server), _decode(day, server, False),
                     _decode(day, server, True), day.span)


def task_prefill_obs(tasks: Sequence[Task], server: ServerSettings) -> list[PrefillObs]:
    """One observation per task whose prompt was computed with no other prompt beside it."""
    return _task_prefill(_Day(tasks, server), server)


def _task_prefill(day: _Day, server: ServerSettings) -> list[PrefillObs]:
    out = []
    for task in day.gen:
        p0, p1 = task.prefill_start_s, task.decode_start_s
        n, ms = task.prompt_n, task.prompt_ms
        if p0 is None or p1 is None or not n or n < MIN_TASK_PROMPT or not ms or (
                id(task) in day.starved):
            continue
        if day.prompt_beside(task, p0, p1) or day.changes(p0, p1):
            continue
        beside = day.decoding(task, p0, p1)
        kctx = sum(_cells(o, p0) for o in beside) / 1000.0
        out.append(prompt_obs(n, task.cache_n or 0, ms, float(len(beside)), server, kctx,
                              day.others(task, (p0 + p1) / 2)))
    return out


def _progress(day: _Day, server: ServerSettings) -> list[PrefillObs]:
    """One observation per iteration between two prompt-progress lines of a task (printed once a
    prompt has run 3 s, then at every iteration), with the tasks decoding beside it."""
    out = []
    for task in day.tasks:
        cache = task.cache_n or 0
        for (t0, n0), (t1, n1) in itertools.pairwise(task.progress):
            if n1 <= n0 or t1 <= t0 or day.prompt_beside(task, t0, t1) or day.changes(t0, t1):
                continue
            beside = day.decoding(task, t0, t1)
            kctx = sum(_cells(o, t0) for o in beside) / 1000.0
            out.append(prompt_obs(n1 - n0, cache + n0, (t1 - t0) * 1000.0, float(len(beside)),
                                  server, kctx, day.others(task, (t0 + t1) / 2)))
    return out


def decode_obs(tasks: Sequence[Task], server: ServerSettings | None = None, *,
               shared: bool = False) -> list[DecodeObs]:
    """One observation per window between two generation-progress lines of a task in which only
    decode steps ran: its steps, their mean time, the slots generating, the cells they attend and,
    with one shared KV (`server`), the cells of its span they read beyond those. `shared`: every
    window of every reply instead, from its first token to its last, cut at those lines, a slot
    that started or stopped generating in it counted for the share of it it generated (the step's
    price is linear in the slots, so their mean prices the mean step)."""
    return _decode(_Day(tasks, server), server, shared)


def _decode(day: _Day, server: ServerSettings | None, shared: bool) -> list[DecodeObs]:
    n_batch = server.n_batch if server is not None else ServerSettings().n_batch
    out = []
    for task in day.streams:
        points = _reply_points(task) if shared else [(t, n) for t, n, _ in task.tg]
        for (t0, n0), (t1, n1) in itertools.pairwise(points):
            if t1 <= t0 or (not shared and day.changes(t0, t1)):
                continue
            apart = day.decode_apart(t0, t1, n1 - n0, n_batch)
            if apart is None:
                continue
            slots, own, scanned = 0.0, 0.0, 0.0
            for other, share, mid in day.generating(t0, t1):
                cells = _cells(other, mid)
                span = day.span(mid) if day.span is not None else 0
                slots += share
                own += share * cells
                scanned += share * max(0.0, span - cells)
            out.append(DecodeObs(apart[0], apart[1] / apart[0], slots, own / 1000.0,
                                 scanned / 1000.0))
    return out


def _reply_points(task: Task) -> list[tuple[float, int]]:
    """(time, tokens generated) at the reply's first token, at each generation-progress line and
    at its last token."""
    first = task.decode_start_s
    if first is None or not task.predicted_ms or not task.predicted_n:
        return []
    last = first + task.predicted_ms / 1000.0
    lines = [(t, n) for t, n, _ in task.tg if first < t < last and 1 < n < task.predicted_n]
    return [(first, 1), *lines, (last, task.predicted_n)]


def kv_span(tasks: Sequence[Task], server: ServerSettings) -> Callable[[float], int]:
    """The shared KV's span (kvcells.py) at any time of the log: each task's launch keeps what its
    slot shared with the prompt (its cached tokens) and, with `cache_idle_slots` and a RAM cache,
    empties every idle slot; its prompt's cells are placed a micro-batch at a time over its
    prefill, its reply's `GEN_CELLS` at a time."""
    events: list[tuple[float, int, int, int]] = []  # (time, order, slot, cells; -1 - kept: launch)
    for task in tasks:
        events.append((task.start_s, 0, task.slot, -1 - (task.cache_n or 0)))
        p0, p1, end = task.prefill_start_s, task.decode_start_s, task.end_s
        for a, b, n, step in ((p0, p1, task.prompt_n, max(1, server.n_ubatch)),
                              (p1, end, task.predicted_n, GEN_CELLS)):
            if a is None or b is None or not n:
                continue
            k = -(-n // step)
            events.extend((a + (b - a) * (i + 1) / k, 1, task.slot, min(step, n - step * i))
                          for i in range(k))
    events.sort()
    running = sorted((t.start_s, t.end_s if t.end_s is not None else float("inf"), t.slot)
                     for t in tasks)
    empties = server.cache_idle_slots and server.cache_ram != 0
    kv = KvCells(server.ctx)
    times, spans = [float("-inf")], [0]
    for t, _, slot, n in events:
        if n >= 0:
            kv.place(slot, n)
        else:
            kv.sync({slot: -1 - n})
            if empties:
                busy = {s for a, b, s in running if a <= t < b}
                kv.sync({s: 0 for s in list(kv.count) if s not in busy and s != slot})
        times.append(t)
        spans.append(kv.span())
    return lambda t: spans[bisect.bisect_right(times, t) - 1]


def used_before(tasks: Sequence[Task], records: Sequence[RecordLine]) -> list[int]:
    """The slots tasks ran in before the log's first request reached the server (a health check,
    a warm-up), oldest first: the least-recently-used choice of every later slot depends on them.
    The first request with timings is found by its prompt and reply sizes."""
    first = next((r for r in sorted(records, key=start_of)
                  if timing(r, "prompt_n") is not None and timing(r, "predicted_n")), None)
    if first is None:
        return []
    sizes = (timing(first, "prompt_n"), timing(first, "predicted_n"))
    match = next((t for t in tasks if (t.prompt_n, t.predicted_n) == sizes), None)
    if match is None:
        return []
    return [t.slot for t in tasks if t.start_s < match.start_s and t.end_s is not None
            and t.end_s <= match.start_s]
