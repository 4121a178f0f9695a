"""Kept KV (keep_kv) as the what-if knows it from a log: the files the log shows requests restored
from, and slotwise's saves. Pure.

A request whose record says `restored_tokens` found a file holding the start of its prompt when it
arrived (saved the day before, or earlier in the log): the tokens the server already had plus those
the restore spared. Restoring it took its `kv_restore` record's `total_ms` (`<id>-restore`), or, for
a restore the log does not time, the log's median per byte of the file. A save (`kv_save`) took
its record's `total_ms` of llama-server's main loop. Which idle conversations slotwise
would have saved under other settings is not modelled (keeping.py saves one only when a modelled
restore pushes it out of its slot).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxy.record.kind import Kind
from proxy.report.records import RecordLine, num, start_of

_SLOT = re.compile(r"^/slots/(\d+)")
RESTORE_SUFFIX = "-restore"
"""A restore's record is named after its request (`proxy/keep/keeper.py`)."""
DEFAULT_RESTORE_MS_PER_MB = 2.0
"""A restore the log does not time, and no other one to learn from: about 500 MB/s."""


@dataclass(frozen=True)
class KeptFile:
    """The file a request restored from in the log."""

    restore_ms: float
    name: str | None = None


@dataclass(frozen=True)
class LoggedSave:
    """A save the log shows: due at `at` (epoch seconds), `ms` of the server's main loop."""

    id: str
    at: float
    ms: float
    slot: int = 0
    tokens: int | None = None
    name: str | None = None


def kept_files(records: Iterable[RecordLine], bytes_per_token: float) -> dict[str, KeptFile]:
    """The file each restored request had, by the request's id."""
    records = list(records)
    restores = {str(r.get("id")): r for r in records if r.get("kind") == Kind.KV_RESTORE.value
                and r.get("outcome") == "done"}
    per_byte = _median_ms_per_byte(restores.values())
    out: dict[str, KeptFile] = {}
    for record in records:
        restored = int(num(record, "restored_tokens") or 0)
        if restored <= 0 or record.get("kind") in (Kind.KV_RESTORE.value, Kind.KV_SAVE.value):
            continue
        rid = str(record.get("id"))
        call = restores.get(rid + RESTORE_SUFFIX)
        took = num(call, "total_ms") if call is not None else None
        if took is None:
            size = num(call, "kv_bytes") if call is not None else None
            took = (size or restored * bytes_per_token) * per_byte
        name = call.get("kv_file") if call is not None else record.get("kv_file")
        out[rid] = KeptFile(float(took), name if isinstance(name, str) else None)
    return out


def logged_saves(records: Iterable[RecordLine]) -> list[LoggedSave]:
    """The saves that went (any outcome but a refusal: each took the main loop's time)."""
    saves: list[LoggedSave] = []
    seen: set[str] = set()
    for n, record in enumerate(r for r in records if r.get("kind") == Kind.KV_SAVE.value):
        took = num(record, "total_ms")
        if took is None or record.get("status") not in (200, None):
            continue
        tokens = num(record, "kv_tokens")
        name = record.get("kv_file")
        slot = _SLOT.search(str(record.get("endpoint") or ""))
        rid = str(record.get("id"))
        rid = rid if rid not in seen else f"{rid}-{n}"
        seen.add(rid)
        saves.append(LoggedSave(rid, start_of(record), float(took),
                                int(slot.group(1)) if slot else 0,
                                int(tokens) if tokens is not None else None,
                                name if isinstance(name, str) else None))
    return sorted(saves, key=lambda s: s.at)


def _median_ms_per_byte(restores: Iterable[RecordLine]) -> float:
    rates = [t / b for r in restores
             if (t := num(r, "total_ms")) is not None and (b := num(r, "kv_bytes")) and b > 0]
    return statistics.median(rates) if rates else DEFAULT_RESTORE_MS_PER_MB / 1e6


def kept_bytes_per_token(records: Iterable[RecordLine]) -> float | None:
    """One token's KV as the log's kept files measure it (their bytes over their tokens, the
    median of the saves and restores that say both); None when none does."""
    sizes = [b / t for r in records if r.get("kind") in (Kind.KV_RESTORE.value, Kind.KV_SAVE.value)
             and (b := num(r, "kv_bytes")) and (t := num(r, "kv_tokens")) and b > 0 and t > 0]
    return statistics.median(sizes) if sizes else None


def shows_keep(records: Sequence[RecordLine]) -> bool:
    """The log was recorded with keep_kv on: it shows saves, restores or restored requests."""
    return any(r.get("kind") in (Kind.KV_RESTORE.value, Kind.KV_SAVE.value)
               or (num(r, "restored_tokens") or 0) > 0 for r in records)
