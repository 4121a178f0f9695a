"""Requests waiting for a slot to restore their kept KV into (keep_kv), as the prefill policy sees
them: who waits, until when, whose restore runs, and which wait ran out. Pure data with a little
arithmetic; the policy decides when a restore starts (rule 14 of `PrefillPolicy`).

A returning conversation whose file is on disk must never be recomputed only because no slot was
idle at the instant it arrived: it waits for the next slot to come free, up to the operator's bound
(`keep_kv.max_wait_s`), unless restoring would cost more than computing.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.events import Arrived, Restorable


@dataclass
class WaitingRestore:
    req: Arrived
    restorable: Restorable
    until: float
    """When it stops waiting for a slot and is computed instead."""
    running: bool = False
    """Its restore was asked for (a slot is counted for it)."""
    needs_a_finish: bool = False
    """Its last restore found no idle slot: it waits for a request to finish before trying again."""


def wait_s(cost: BatchCost, req: Arrived, restorable: Restorable, n_batch: int) -> float:
    """How long a request may wait for a slot: `restorable.max_wait_s`, the operator's bound,
    unless computing what the file spares would take no longer than restoring it, even alone
    (then not at all). The time alone is no bound for the wait: beside others a history is fed in
    pieces and holds, far slower (bench day, -np 4 -kvu: a 4,118-token history that waited its
    6 s alone for a slot was then computed in 155 s; its file restores in under a second)."""
    cached = max(0, req.est_prompt_tokens - req.est_new_tokens)
    compute_ms = cost.prompt_ms(restorable.tokens, cached, n_batch)
    return restorable.max_wait_s if compute_ms > restorable.restore_ms else 0.0


class RestoreLine:
    """The waiting restores, in arrival order."""

    def __init__(self) -> None:
        self.waiting: dict[str, WaitingRestore] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.waiting

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def add(self, req: Arrived, restorable: Restorable, wait: float) -> None:
        self.waiting[req.req_id] = WaitingRestore(req, restorable, until=req.now + wait)

    def running(self) -> int:
        return sum(1 for w in self.waiting.values() if w.running)

    def expired(self, now: float) -> list[WaitingRestore]:
        """Those not running whose wait ran out: they leave the line."""
        gone = [w for w in self.waiting.values() if not w.running and now >= w.until]
        for w in gone:
            del self.waiting[w.req.req_id]
        return gone

    def start(self, free_slots: int) -> list[str]:
        """The next ones to restore, one per free slot, in arrival order."""
        started: list[str] = []
        for w in self.waiting.values():
            if len(started) >= free_slots:
                break
            if not w.running and not w.needs_a_finish:
                w.running = True
                started.append(w.req.req_id)
        return started

    def pop(self, req_id: str) -> WaitingRestore | None:
        return self.waiting.pop(req_id, None)

    def a_request_finished(self) -> None:
        for w in self.waiting.values():
            w.needs_a_finish = False

    def next_wakeup(self) -> float | None:
        return min((w.until for w in self.waiting.values() if not w.running), default=None)
