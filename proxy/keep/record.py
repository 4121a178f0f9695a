"""The timing records of slotwise's own saves and restores (kinds `kv_save`, `kv_restore`): made like
every request's, from a `Flight` the keeper fills, one per call to llama-server. Pure.

Their fields say: `endpoint` the call (`/slots/N?action=save`), `status` llama-server's answer,
`outcome` done, changed (a save whose slot changed meanwhile: deleted), failed, client_gone (a restore
whose request left), `error` why, `total_ms` the call's time, `prompt_tokens` the tokens the file
holds, `restored_tokens` (restores) those of them the request's prompt shares, `kv_bytes` the file's
size, `policy_note` the file's name (docs/keep-kv.md). A restore's record has the request's `client`.
"""

from __future__ import annotations

from dataclasses import replace

from proxy.record.flight import Flight
from proxy.record.kind import Kind
from proxy.record.schema import Record, build_record
from proxy.record.timing import RequestTimer

SAVE_KIND = "kv_save"
RESTORE_KIND = "kv_restore"


def kv_flight(call_id: str, slot: int, action: str, file: str, *, now: float, wall: float,
              config_gen: int, client: str | None = None, node: str | None = None) -> Flight:
    """The facts of one save or restore from its start. Its kind is `other` until the record says
    which: it is never a request in flight."""
    flight = Flight(id=call_id, kind=Kind.OTHER, method="POST",
                    endpoint=f"/slots/{slot}?action={action}", wall_start=wall,
                    config_gen=config_gen, timer=RequestTimer(arrived=now), client=client, node=node)
    flight.prefill.note = file
    return flight


def kv_record(flight: Flight, kind: str, now: float) -> Record:
    """The record, once the call ended (`flight` has its status, outcome and figures)."""
    flight.timer.on_end(now)
    return replace(build_record(flight), kind=kind)
