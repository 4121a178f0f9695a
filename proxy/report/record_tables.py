"""Aggregation that only timing records allow: decode rate inside others' prefills (from
`overlaps`), LoRA rewrites, the prefill policy's actions and the estimate's accuracy.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence

from proxy.record.refusals import requests_in
from proxy.report.model import Row, Table, quantile
from proxy.report.records import RecordLine, fed_tokens, new_tokens, num, overlap_tokens


def decode_rate_table(records: Sequence[RecordLine], long_prefill: int) -> Table:
    """Per-request decode event rates inside overlaps with a long prefill, versus the rest."""
    during: list[float] = []
    rest: list[float] = []
    pooled = [[0.0, 0.0], [0.0, 0.0]]  # events, ms: during, rest
    for record in records:
        split = _split_decode(record, long_prefill)
        if split is None:
            continue
        for i, (events, ms) in enumerate(split):
            if ms > 0:
                (during if i == 0 else rest).append(events / (ms / 1000))
                pooled[i][0] += events
                pooled[i][1] += ms
    rows = []
    for label, rates, (events, ms) in (
        (f"while another slot prefilled >= {long_prefill:,} tokens", during, pooled[0]),
        ("otherwise", rest, pooled[1]),
    ):
        rows.append(
            Row(
                label,
                len(rates),
                (
                    quantile(rates, 0.5),
                    min(rates, default=None),
                    events / (ms / 1000) if ms else None,
                    ms / 1000,
                ),
            )
        )
    return Table(
        "decode_rate",
        "Decode rate of streams (token events per second)",
        ("median", "min", "pooled", "decode time"),
        ("ev/s", "ev/s", "ev/s", "s"),
        tuple(rows),
        note="one sample per request and condition",
    )


def _split_decode(record: RecordLine, threshold: int) -> tuple[tuple[float, float], ...] | None:
    events, ms = num(record, "events"), num(record, "decode_ms")
    if events is None or not ms:
        return None
    in_events = in_ms = 0.0
    for ov in record.get("overlaps") or ():
        if isinstance(ov, Mapping) and (overlap_tokens(ov) or 0) >= threshold:
            in_events += num(ov, "decode_events") or 0.0
            in_ms += num(ov, "decode_ms") or 0.0
    # Overlaps of two long prefills at once would count twice: never exceed the whole decode.
    in_ms, in_events = min(in_ms, ms), min(in_events, events)
    return (in_events, in_ms), (events - in_events, ms - in_ms)


def requests_table(records: Sequence[RecordLine]) -> Table:
    """Outcomes and LoRA rewrites: counts only."""
    outcomes: Counter[str] = Counter()
    for record in records:  # a summary of refusals stands for its `refused_count` requests
        outcomes[str(record.get("outcome"))] += requests_in(record)
    rows = [Row("requests", outcomes.total(), ())]
    rows += [Row(f"outcome {k}", v, ()) for k, v in sorted(outcomes.items())]
    rows.append(Row("LoRA rewritten", sum(1 for r in records if r.get("lora_rewritten")), ()))
    return Table("requests", "Requests and LoRA rewrites", (), (), tuple(rows), n_label="requests")


PLANS = (
    ("none", "forwarded at once"),
    ("held", "held, then forwarded (defer)"),
    ("chunked", "fed in pieces (chunk)"),
    ("trimmed", "a trim piece first, its last micro-batch one tile"),
)


def policy_table(records: Sequence[RecordLine]) -> Table:
    """What the prefill policy did to each request (`prefill_plan`), and how long it held them."""
    rows = []
    known = {plan for plan, _ in PLANS}
    by_plan: dict[str, list[RecordLine]] = {}
    for r in records:
        by_plan.setdefault(str(r.get("prefill_plan") or "none"), []).append(r)
    labels = [*PLANS, *((p, f"plan {p}") for p in sorted(by_plan) if p not in known)]
    for plan, label in labels:
        group = by_plan.get(plan, [])
        held = [(num(r, "held_ms") or 0.0) / 1000 for r in group]
        share = 100 * len(group) / len(records) if records else None
        if plan == "none":  # never held: no held time to show
            rows.append(Row(label, len(group), (share, None, None)))
        else:
            rows.append(Row(label, len(group), (share, *_held(held))))
    waits = [w / 1000 for r in records if (w := num(r, "slot_wait_ms") or 0.0) > 0]
    if waits:  # of those held or fed: what more slots would have spared
        rows.append(Row("of them, waiting for a free slot", len(waits),
                        (100 * len(waits) / len(records), *_held(waits))))
    chunked = by_plan.get("chunked", [])
    pieces = sum(int(num(r, "pieces") or 0) for r in chunked)
    fed = sum(fed_tokens(r) for r in chunked)
    if not chunked:
        note = ""
    elif any("fed_tokens" in r for r in chunked):
        note = f"chunk: {pieces:,} pieces fed ahead, {fed:,} prompt tokens computed in them"
    else:
        note = f"chunk: {pieces:,} pieces fed ahead (their tokens unknown: no fed_tokens in this log)"
    return Table(
        "prefill_plan",
        "Prefill policy: what it did to each request (prefill_plan)",
        ("share", "median held", "max held"),
        ("%", "s", "s"),
        tuple(rows),
        note=note,
        n_label="requests",
    )


def _held(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.median(values), max(values)


# What `policy_note` says, by kind (the texts come from proxy/prefill/: the gate and the policy).
# The policy leaves no note for its usual cases (proxy/prefill/deciding.py QUIET_REASONS).
NOTE_KINDS = (
    ("released after pieces: the rest fits one piece", False),
    ("released after pieces: nobody generating", False),
    ("cold, admitted whole: nobody generating", False),
    ("cold, admitted whole: fits one piece", False),
    ("held until others finished (defer)", False),
    ("held until prefill.max_hold_s (defer)", False),
    ("released by a reload (prefill.mode off)", False),
    ("other note", False),
    ("failed open: not estimated", True),
    ("failed open: piece failed", True),
    ("failed open: internal error", True),
)


def note_kind(note: str) -> str:
    """The kind of a `policy_note` (one of NOTE_KINDS' labels)."""
    if note.startswith("not estimated"):
        return "failed open: not estimated"
    if note.startswith("internal error") or (
        note.startswith("piece failed") and "internal error" in note
    ):
        return "failed open: internal error"
    if note.startswith("piece failed"):
        return "failed open: piece failed"
    if note.startswith("held until others finished"):
        return "held until others finished (defer)"
    if note.startswith("held prefill.max_hold_s") or "max_hold" in note:
        return "held until prefill.max_hold_s (defer)"
    if "(reload)" in note:
        return "released by a reload (prefill.mode off)"
    if note.startswith("cold, "):
        if "nobody generating" in note:
            return "cold, admitted whole: nobody generating"
        if "fits one piece" in note:
            return "cold, admitted whole: fits one piece"
    elif " pieces (" in note:
        if note.startswith("rest fits one piece"):
            return "released after pieces: the rest fits one piece"
        if note.startswith("nobody generating"):
            return "released after pieces: nobody generating"
    return "other note"


def notes_table(records: Sequence[RecordLine]) -> Table:
    """Why the policy released or admitted each request, and when it did not apply (failed open)."""
    kinds = Counter(
        note_kind(note) for r in records if isinstance(note := r.get("policy_note"), str) and note
    )
    noted = sum(kinds.values())
    rows = [Row("no note (not cold, policy off, or not generating)", len(records) - noted, ())]
    # Fail-open rows are always shown, also when 0: that is the figure to watch.
    rows += [Row(label, kinds[label], ()) for label, fail in NOTE_KINDS if kinds[label] or fail]
    failed = sum(kinds[label] for label, fail in NOTE_KINDS if fail)
    rows.append(Row("failed open, all kinds (the policy did not apply)", failed, ()))
    return Table(
        "policy_notes",
        "Prefill policy: why it released or admitted requests (policy_note)",
        (),
        (),
        tuple(rows),
        n_label="requests",
    )


def estimate_table(records: Sequence[RecordLine]) -> Table:
    """est_new_tokens against the new tokens the server computed (prompt_n + fed_tokens)."""
    pairs = [(num(r, "est_new_tokens"), new_tokens(r)) for r in records]
    known = [(e, a) for e, a in pairs if e is not None and a is not None]
    errors = [e - a for e, a in known]
    rel = [abs(e - a) / a for e, a in known if a > 0]
    within = 100 * sum(1 for x in rel if x <= 0.1) / len(rel) if rel else None
    row = Row(
        "estimate - actual new tokens",
        len(known),
        (
            statistics.median(errors) if errors else None,
            quantile([abs(x) for x in errors], 0.95),
            max((abs(x) for x in errors), default=None),
            within,
        ),
    )
    return Table(
        "estimate",
        "Estimate accuracy (est_new_tokens vs timings.prompt_n + fed_tokens)",
        ("median error", "p95 |error|", "max |error|", "within 10%"),
        ("tok", "tok", "tok", "%"),
        (row,),
    )
