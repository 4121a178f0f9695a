"""The warm-ups a log shows, as the replay asks for them: when (its client's previous request's end
plus the same pause, as the chat app calls it after a summary, else its logged time), by whom,
with which LoRA settings, and its prefix: the first tokens of the turn it was for, the request
credited with its work (`warm_ids`), else its client's next request; the log has no ids, and
that turn's prompt, built by requests.py, holds the same tokens. A warm-up that restored a kept file
in the log carries how many of its prefix's first tokens the file held (`kept`: what requests.py
counted as restored for its turn, `Workload.restored_by_warm_up`). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.report.records import RecordLine, num, start_of
from proxy.whatif.prompts import Seq
from proxy.whatif.requests import RETURN_GAP_S, Job, lora_asked, pause_after


@dataclass(frozen=True)
class WarmJob:
    """One logged warm-up call, as the replay sends it to the warm-up queue."""

    id: str
    record: RecordLine
    arrival: float
    """Epoch seconds."""
    client: str | None
    prefix: Seq
    """The tokens it asks to compute (the queue finds what the server holds of them)."""
    lora_in: Any
    after: str | None = None
    """Its client's request it followed (sent `think_s` after that one's end in the replay)."""
    think_s: float = 0.0
    kept: int = 0
    """The prefix's first tokens the kept file it restored in the log held (keep_kv, the warm-up
    queue's rule 10; the file is the workload's under its id); 0: none, or its turn did not find
    them."""


@dataclass
class WarmPlan:
    jobs: list[WarmJob]
    unplaced: list[RecordLine]
    """The records of warm-ups not replayed (copied as they were): no size logged (refused before
    their body was read) or no later request of their client to take the prefix from."""


def warm_jobs(records: Sequence[RecordLine], jobs: Sequence[Job],
              return_gap_s: float = RETURN_GAP_S,
              restored: Mapping[str, str] | None = None) -> WarmPlan:
    """`records`: the log's warm-up records; `jobs`: the requests the replay runs, in arrival
    order; `restored`: warm-up id → its turn's id, for those that restored a kept file
    (`Workload.restored_by_warm_up`)."""
    restored = restored or {}
    credited = {str(w): job for job in jobs for w in (job.record.get("warm_ids") or ())}
    by_id = {job.id: job for job in jobs}
    for wid, turn_id in restored.items():
        if turn_id in by_id:
            credited.setdefault(wid, by_id[turn_id])
    plan = WarmPlan([], [])
    for record in sorted(records, key=start_of):
        wid, arrival = str(record.get("id")), start_of(record)
        client = record.get("client") if isinstance(record.get("client"), str) else None
        tokens = num(record, "prompt_tokens")
        turn = credited.get(wid) or next(
            (j for j in jobs if client is not None and j.client == client and j.arrival >= arrival),
            None)
        if turn is None or tokens is None or tokens < 1:
            plan.unplaced.append(record)
            continue
        before = [j for j in jobs if j.client == client and j.arrival < arrival and client is not None]
        think = pause_after(before[-1].record, arrival, return_gap_s) if before else None
        kept = min(int(tokens), turn.kept) if restored.get(wid) == turn.id else 0
        plan.jobs.append(WarmJob(
            id=wid, record=record, arrival=arrival, client=client,
            prefix=turn.prompt.prefix(int(tokens)), lora_in=lora_asked(record),
            after=before[-1].id if think is not None else None, think_s=think or 0.0, kept=kept))
    return plan

