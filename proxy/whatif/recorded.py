"""What a log was recorded under, as far as it tells: llama-server's flags from its own log's start-up
lines (else llama-server's defaults), slotwise's `[prefill]` mode, `[lora]` profile and
`[keep_kv]` from what the records show slotwise did (unless the recorded config file is given).
Each guess is said. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proxy.config import KeepKvConfig
from proxy.record.kind import Kind
from proxy.report.records import RecordLine, num
from proxy.whatif.kept import shows_keep


def recorded_server(found: Mapping[str, Any], given: Mapping[str, Any]) -> tuple[dict[str, Any],
                                                                                 list[str]]:
    """The recorded flags: `given` (--recorded) over `found` (the server log); what is neither is
    llama-server's default, and the notes say which."""
    values = {**found, **given}
    notes = []
    defaulted = [k for k in ("n_batch", "n_ubatch", "parallel", "kv_unified", "ctx") if k not in values]
    if defaulted:
        notes.append(f"recorded llama-server flags not in its log, taken as its defaults: "
                     f"{', '.join(defaulted)} (say them with --recorded KEY=VALUE)")
    return values, notes


def recorded_config(records: Sequence[RecordLine]) -> tuple[dict[str, Any], list[str]]:
    """A config mapping for what the records show slotwise did (no config file given)."""
    data: dict[str, Any] = {}
    notes: list[str] = []
    mode = _prefill_mode(records, keep=shows_keep(records))
    if mode != "off":
        data["prefill"] = {"mode": mode}
        notes.append(f"recorded prefill.mode taken as {mode!r} from the records (give the "
                     "recorded config with --config)")
    lora = _lora(r.get("lora_out") for r in records if r.get("lora_rewritten") is True)
    if lora is not None:
        data["lora"] = lora
        notes.append(f"recorded lora.mode taken as {lora['mode']!r} from the records")
    if shows_keep(records):
        keep: dict[str, Any] = {"enabled": True}
        restored = [int(n) for r in records if (n := num(r, "restored_tokens")) and n > 0]
        if restored and min(restored) < KeepKvConfig.min_tokens:
            keep["min_tokens"] = min(restored)  # it restored that little: its bound was lower
        data["keep_kv"] = keep
        notes.append("recorded keep_kv taken as on from the records (they show saves or restores)")
    return data, notes


def _prefill_mode(records: Iterable[RecordLine], *, keep: bool) -> str:
    """`chunk` when a record shows pieces; `defer` when one shows an estimate (with keep_kv on,
    every request has one in any mode: then only when one says it was cold); else `off`."""
    mode = "off"
    for record in records:
        if record.get("kind") == Kind.WARM:  # a warm-up has pieces in every mode
            continue
        if record.get("pieces") or record.get("prefill_plan") == "chunked":
            return "chunk"
        if record.get("est_new_tokens") is not None and (
                not keep or "cold" in str(record.get("policy_note") or "")):
            mode = "defer"
    return mode


def _lora(rewritten: Iterable[Any]) -> dict[str, Any] | None:
    for value in rewritten:
        if not isinstance(value, list):
            continue
        adapters = [{"id": e["id"], "scale": float(e.get("scale", 1.0))} for e in value
                    if isinstance(e, Mapping) and isinstance(e.get("id"), int)
                    and e.get("scale", 1.0) != 0]
        return {"mode": "fixed", "adapters": adapters} if adapters else {"mode": "none"}
    return None
