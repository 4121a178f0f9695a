"""Aggregation that only timing records allow: decode rate inside others' prefills (from
`overlaps`), LoRA rewrites, the prefill policy's actions and the estimate's accuracy.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence

from proxy.report.model import Row, Table, quantile
from proxy.report.records import Record, num, timing


def decode_rate_table(records: Sequence[Record], long_prefill: int) -> Table:
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


def _split_decode(record: Record, threshold: int) -> tuple[tuple[float, float], ...] | None:
    events, ms = num(record, "events"), num(record, "decode_ms")
    if events is None or not ms:
        return None
    in_events = in_ms = 0.0
    for ov in record.get("overlaps") or ():
        if isinstance(ov, Mapping) and (num(ov, "new_tokens") or 0) >= threshold:
            in_events += num(ov, "decode_events") or 0.0
            in_ms += num(ov, "decode_ms") or 0.0
    # Overlaps of two long prefills at once would count twice: never exceed the whole decode.
    in_ms, in_events = min(in_ms, ms), min(in_events, events)
    return (in_events, in_ms), (events - in_events, ms - in_ms)


def requests_table(records: Sequence[Record]) -> Table:
    """Outcomes, LoRA rewrites and the prefill policy's actions."""
    rows = [Row("requests", len(records), (None,))]
    outcomes = Counter(str(r.get("outcome")) for r in records)
    rows += [Row(f"outcome {k}", v, (None,)) for k, v in sorted(outcomes.items())]
    rows.append(Row("LoRA rewritten", sum(1 for r in records if r.get("lora_rewritten")), (None,)))
    plans = Counter(str(r.get("prefill_plan") or "none") for r in records)
    for plan, count in sorted(plans.items()):
        held = [num(r, "held_ms") or 0.0 for r in records if (r.get("prefill_plan") or "none") == plan]
        rows.append(Row(f"prefill plan {plan}", count, (sum(held) / 1000,)))
    pieces = sum(int(num(r, "pieces") or 0) for r in records)
    rows.append(Row("prompt pieces fed ahead", pieces, (None,)))
    notes = sum(1 for r in records if r.get("policy_note"))
    rows.append(Row("policy failed open (policy_note)", notes, (None,)))
    return Table(
        "requests",
        "Requests, LoRA rewrites and prefill policy",
        ("held",),
        ("s",),
        tuple(rows),
        n_label="count",
    )


def estimate_table(records: Sequence[Record]) -> Table:
    """est_new_tokens against the server's prompt_n."""
    pairs = [(num(r, "est_new_tokens"), timing(r, "prompt_n")) for r in records]
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
        "Estimate accuracy (est_new_tokens vs timings.prompt_n)",
        ("median error", "p95 |error|", "max |error|", "within 10%"),
        ("tok", "tok", "tok", "%"),
        (row,),
    )
