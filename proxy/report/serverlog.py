"""Parser for llama-server's log: each line becomes an event, or is counted in a category.

Timestamps are `minutes.seconds.milliseconds.microseconds` since the server started (or `--log-jsonl`
objects with microseconds). Nothing is dropped silently: every line lands in `ParsedLog.counts`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

PREFIX = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) ([IWEDT]) (.*)$")
SLOT = re.compile(r"^slot +(\S+): id +(-?\d+) \| task (-?\d+) \| (.*)$")
SERVER = re.compile(r"^(srv|que) +(\S+): (.*)$")
NUM = r"([-+]?(?:\d+(?:\.\d*)?|nan|inf))"
MESSAGES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("launch", re.compile(r"^processing task(?:, is_child = \d+)?$")),
    ("selected", re.compile(r"^selected slot by (id|LCP similarity|LRU)\b")),
    (
        "pp_progress",
        re.compile(rf"^prompt processing, n_tokens = +(\d+), progress = {NUM}, t = +{NUM} s / {NUM} tokens"),
    ),
    ("tg_progress", re.compile(rf"^n_gen = +(\d+), tg = +{NUM} t/s, tg_3s = +{NUM} t/s")),
    ("prompt_eval", re.compile(rf"^prompt eval time = +{NUM} ms / +(\d+) tokens")),
    ("eval", re.compile(rf"^eval time = +{NUM} ms / +(\d+) tokens")),
    ("total", re.compile(rf"^total time = +{NUM} ms / +(\d+) tokens")),
    ("release", re.compile(r"^stop processing: n_tokens = (\d+), truncated = (\d+)")),
)
# Slot lines a task rebuild does not need, by how they begin.
KNOWN_SLOT = (
    "graphs reused",
    "draft acceptance",
    "acc per pos",
    "accepted",
    "new prompt",
    "cached n_tokens",
    "n_past",
    "erasing old context checkpoint",
    "created context checkpoint",
    "restored context",
    "saving",
    "restoring",
    "prompt done",
    "failed to",
    "slot is not processing",
    "slot context shift",
    "need to evaluate",
    "empty prompt",
    "cache reuse",
    "got exception",
    "kv cache rm",
    "found better",
    "updating",
    "clearing cache",
    "forcing full prompt",
    "n_tokens =",
    "prompt cache",
    "reusing",
    "context checkpoint",
    "truncated",
    "input truncated",
    "waiting for",
)
SERVER_EVENTS = (
    ("cancel", re.compile(r"cancel task, id_task = (\d+)")),
    ("error", re.compile(r"task id = (\d+), error: (.*)")),
)

TASK_LINES = "task lines (used)"
SLOT_OTHER = "slot lines, known (not needed)"
UNRECOGNISED = "slot lines, unrecognised"
SERVER_LINES = "server and queue lines"
STARTUP = "other/startup lines"
NO_PREFIX = "lines without a timestamp prefix"
BLANK = "blank lines"


@dataclass(frozen=True)
class Event:
    t: float
    kind: str
    slot: int
    task: int
    run: int
    values: tuple[str, ...]


@dataclass
class ParsedLog:
    events: list[Event] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    unrecognised: list[tuple[int, str]] = field(default_factory=list)
    """Line number and text of the first unrecognised lines, to show the user."""
    runs: int = 0
    lines: int = 0

    @property
    def stamped(self) -> int:
        return self.lines - self.counts[NO_PREFIX] - self.counts[BLANK]


def parse_server_log(lines: Iterable[str]) -> ParsedLog:
    log = ParsedLog(runs=1)
    offset, last = 0.0, 0.0
    for number, raw in enumerate(lines, 1):
        log.lines += 1
        line = raw.rstrip("\r\n")
        stamped = _split_prefix(line)
        if stamped is None:
            log.counts[BLANK if not line.strip() else NO_PREFIX] += 1
            continue
        t, message = stamped
        if t + offset < last - 5.0:  # the clock went back: the server restarted
            offset, log.runs = last, log.runs + 1
        last = max(last, t + offset)
        _classify(log, number, t + offset, message)
    return log


def _split_prefix(line: str) -> tuple[float, str] | None:
    match = PREFIX.match(line)
    if match:
        m, s, ms, us = (int(g) for g in match.groups()[:4])
        return m * 60 + s + ms / 1e3 + us / 1e6, match.group(6)
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        if isinstance(obj, dict) and obj.get("type") == "log" and isinstance(obj.get("time"), int):
            return obj["time"] / 1e6, str(obj.get("msg", "")).rstrip("\n")
    return None


def _classify(log: ParsedLog, number: int, t: float, message: str) -> None:
    slot = SLOT.match(message)
    if slot is not None:
        _slot_line(log, number, t, slot.group(2), slot.group(3), slot.group(4).strip())
        return
    server = SERVER.match(message)
    if server is None:
        log.counts[STARTUP] += 1
        return
    log.counts[SERVER_LINES] += 1
    for kind, pattern in SERVER_EVENTS:
        match = pattern.search(server.group(3))
        if match:
            task = int(match.group(1))
            log.events.append(Event(t, kind, -1, task, log.runs, match.groups()[1:]))


def _slot_line(log: ParsedLog, number: int, t: float, slot: str, task: str, msg: str) -> None:
    for kind, pattern in MESSAGES:
        match = pattern.match(msg)
        if match:
            log.counts[TASK_LINES] += 1
            log.events.append(Event(t, kind, int(slot), int(task), log.runs, match.groups()))
            return
    if msg.startswith(KNOWN_SLOT):
        log.counts[SLOT_OTHER] += 1
        return
    log.counts[UNRECOGNISED] += 1
    if len(log.unrecognised) < 5:
        log.unrecognised.append((number, msg))
