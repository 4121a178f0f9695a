"""keep_kv's table (docs/keep-kv.md): saves and restores from their own records (kinds `kv_save`,
`kv_restore`), the requests whose prefix was restored (`restored_tokens`), and the time that spared.

Time saved is estimated: the restored tokens at this log's own prefill cost (the median ms per
computed prompt token of requests that computed at least `COST_MIN_TOKENS`), minus the restores'
own time. Pure aggregation.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from proxy.record.kind import Kind
from proxy.record.outcome import Outcome
from proxy.report.model import Row, Table
from proxy.report.records import RecordLine, num, timing

KINDS = (Kind.KV_SAVE, Kind.KV_RESTORE)
COST_MIN_TOKENS = 512
"""Requests that computed at least this many prompt tokens give the log's prefill cost per token."""


def keep_tables(records: Sequence[RecordLine]) -> tuple[Table, ...]:
    """The table, where keep_kv saved or restored anything (else none)."""
    if any(r.get("kind") in KINDS or (num(r, "restored_tokens") or 0) > 0 for r in records):
        return (keep_table(records),)
    return ()


def keep_table(records: Sequence[RecordLine]) -> Table:
    by_kind: dict[str, list[RecordLine]] = {kind: [] for kind in KINDS}
    for r in records:
        if r.get("kind") in by_kind:
            by_kind[str(r.get("kind"))].append(r)
    rows = [*_calls("save", by_kind[Kind.KV_SAVE]), *_calls("restore", by_kind[Kind.KV_RESTORE])]
    restored = [r for r in records if r.get("kind") not in by_kind and (num(r, "restored_tokens") or 0) > 0]
    spared = sum(int(num(r, "restored_tokens") or 0) for r in restored)
    ttfts = [t / 1000 for r in restored if (t := num(r, "ttft_ms")) is not None]
    rows.append(Row("requests with a restored prefix", len(restored),
                    (float(spared), statistics.median(ttfts) if ttfts else None, None)))
    per_token = prefill_ms_per_token(records)
    restore_s = sum((num(r, "total_ms") or 0.0) / 1000 for r in by_kind[Kind.KV_RESTORE]
                    if r.get("outcome") == Outcome.DONE)
    saved_s = None if per_token is None else spared * per_token / 1000 - restore_s
    rows.append(Row("time saved (estimated)", len(restored), (float(spared), saved_s, None)))
    cost = "no request in this log computed enough to price a token" if per_token is None else (
        f"at {per_token:.2f} ms per prompt token (median of requests that computed >= "
        f"{COST_MIN_TOKENS:,}), minus the restores' time")
    return Table(
        "keep_kv", "keep_kv: conversations saved to disk and restored instead of recomputed",
        ("tokens", "time", "size"), ("tok", "s", "GB"), tuple(rows),
        note=f"time: the calls' total; for requests, the median time to first token. Saved: {cost}",
        n_label="count")


def _calls(action: str, records: Sequence[RecordLine]) -> list[Row]:
    rows = []
    for outcome in sorted({str(r.get("outcome")) for r in records} | {"done"}):
        group = [r for r in records if r.get("outcome") == outcome]
        rows.append(Row(f"{action}s {outcome}", len(group), (
            sum(_file_tokens(r) for r in group),
            sum(num(r, "total_ms") or 0.0 for r in group) / 1000,
            sum(num(r, "kv_bytes") or 0.0 for r in group) / 1e9)))
    return rows


def _file_tokens(record: RecordLine) -> float:
    """The tokens a save's or restore's file holds: `kv_tokens` (logs written before that field
    had them in `prompt_tokens`)."""
    return num(record, "kv_tokens") or num(record, "prompt_tokens") or 0.0


def prefill_ms_per_token(records: Sequence[RecordLine]) -> float | None:
    """The median server prompt time per computed token of requests that computed many."""
    costs = []
    for r in records:
        prompt_n, prompt_ms = timing(r, "prompt_n"), timing(r, "prompt_ms")
        if prompt_n is not None and prompt_ms is not None and prompt_n >= COST_MIN_TOKENS:
            costs.append(prompt_ms / prompt_n)
    return statistics.median(costs) if costs else None
