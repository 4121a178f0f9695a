"""The slot each logged request ran in, by llama-server's log: the task of the same prompt and
reply sizes (`timings.prompt_n`, `predicted_n`), the one launched nearest the request's arrival
when several are that size (the logs' clocks set apart as `cutsizes.log_offset` finds). Pure.

Replaying a day on as many slots as it had, with slotwise sending the same tasks, a request that
would take the least recently used slot takes the one the server gave it, if idle in the model
too (the server model's rule 1; a slot holding its prefix still comes first). Which slot a
request lands in decides, with other LoRA settings, how long it waits for a batch of its own
(only requests of the first generating slot's settings share one); once one request's timing
differs, the model's own choices drift from the server's (docs/whatif.md, "Its measured error").
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.report.records import RecordLine, start_of
from proxy.report.tasks import Task
from proxy.whatif.cutsizes import log_offset, record_size, tasks_by_size


def recorded_slots(tasks: Sequence[Task], records: Sequence[RecordLine]) -> dict[str, int]:
    """Record id → the slot its task ran in, for the requests with sizes the log shows a task of."""
    by_size, offset = tasks_by_size(tasks), log_offset(tasks, records)
    claimed: set[int] = set()
    slots: dict[str, int] = {}
    for record in sorted(records, key=start_of):
        size = record_size(record)
        if size is None:
            continue
        found = [t for t in by_size.get(size, []) if id(t) not in claimed]
        if len(found) > 1 and offset is not None:
            arrived = start_of(record) + offset
            found.sort(key=lambda t: abs(t.start_s - arrived))
        elif len(found) > 1:
            continue  # several of its size and no clock to tell them apart
        if found:
            claimed.add(id(found[0]))
            slots[str(record.get("id"))] = found[0].slot
    return slots
