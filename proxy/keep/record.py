"""The timing records of slotwise's own saves and restores (kinds `kv_save`, `kv_restore`): made like
every request's, from a `Flight` the keeper fills, one per call to llama-server. Pure.

Their fields say: `endpoint` the call (`/slots/N?action=save`), `status` llama-server's answer,
`outcome` done, changed (a save whose slot changed meanwhile: deleted), failed, client_gone (a restore
whose request left), `error` why, `total_ms` the call's time, `kv_file` the file's name, `kv_tokens`
the tokens it holds (saved, or read back), `kv_bytes` its size, `restored_tokens` (restores) those of
them the request's prompt shares, `policy_note` what else happened (a conversation a restore
displaced; a save deleted at once) (docs/keep-kv.md). A restore's record has the request's `client`.
"""

from __future__ import annotations

from proxy.record.flight import Flight
from proxy.record.kind import Kind
from proxy.record.schema import Record, build_record
from proxy.record.timing import RequestTimer

ACTIONS = {Kind.KV_SAVE: "save", Kind.KV_RESTORE: "restore"}


def kv_flight(call_id: str, slot: int, kind: Kind, file: str, *, now: float, wall: float,
              config_gen: int, client: str | None = None, node: str | None = None) -> Flight:
    """The facts of one save or restore (`kind`) from its start; it is never a request in flight."""
    return Flight(id=call_id, kind=kind, method="POST",
                  endpoint=f"/slots/{slot}?action={ACTIONS[kind]}", wall_start=wall,
                  config_gen=config_gen, timer=RequestTimer(arrived=now), client=client, node=node,
                  kv_file=file)


def kv_record(flight: Flight, now: float) -> Record:
    """The record, once the call ended (`flight` has its status, outcome and figures)."""
    flight.timer.on_end(now)
    return build_record(flight)
