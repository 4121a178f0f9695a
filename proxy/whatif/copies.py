"""How fast llama-server saves a prompt to its RAM cache (`server.save_gb_s`), from its log's slot
switches. Pure.

When llama-server gives a task the least recently used slot, it first copies the prompt that slot
holds into its RAM cache (`get_available_slot`, `prompt_save`), on its main loop: every generating
slot waits. The log at its default verbosity times that switch (`Task.slot_switch_ms`: the slot
chosen, then the task launched) and says what the slot held (its last task's `n_tokens` at
release). On the testbed the copy ran at 15-80 µs a token (0.3-1.6 GB/s of KV), where 10 GB/s had
been assumed (`bench day`, 2026-12-06: a slot of 7,132 tokens took 450-570 ms to switch on
`-np 5`). A cached prompt copied back into a slot, the other way, was several times faster (6,877
tokens in ~27 ms: `copy_gb_s`, not fitted here).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from proxy.report.task_tables import SLOW_SWITCH_MS
from proxy.report.tasks import Task

MIN_SWITCHES = 3
"""Fewer timed copies than this leave the speed as it was."""
MAX_REUSED = 0.1
"""A task that reused more than this share of its prompt may have had a cached prompt copied back
as well (a restore from the RAM cache): its switch times two copies, not one."""


def save_gb_s(tasks: Iterable[Task], bytes_per_token: float) -> tuple[float, int] | None:
    """The median speed of the log's timed copies into the RAM cache, in GB of KV a second, and
    how many there were; None under MIN_SWITCHES. A copy is a switch to the least recently used
    slot that took SLOW_SWITCH_MS or more (a quicker one copied nothing: the cache held that
    prompt already, or the slot was empty) by a task that reused little of its prompt."""
    held: dict[tuple[int, int], int] = {}
    speeds: list[float] = []
    for task in sorted(tasks, key=lambda t: (t.run, t.start_s)):
        before = held.get((task.run, task.slot))
        switch = task.slot_switch_ms
        if (task.selected_by == "LRU" and before and switch is not None
                and switch >= SLOW_SWITCH_MS and _reused_little(task)):
            speeds.append(before * bytes_per_token / (switch / 1000.0) / 1e9)
        if task.n_tokens is not None:
            held[(task.run, task.slot)] = task.n_tokens
    if len(speeds) < MIN_SWITCHES:
        return None
    return statistics.median(speeds), len(speeds)


def _reused_little(task: Task) -> bool:
    cached, computed = task.cache_n, task.prompt_n
    if cached is None or computed is None:
        return False
    return cached <= MAX_REUSED * (cached + computed)
