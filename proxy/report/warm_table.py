"""The warm-ups table: how many, how they ended, the tokens they computed, how many a later turn
found (the hit rate), and the time to first token of warmed turns against cold ones. Pure
aggregation over timing records (kind `warm`, and every turn's `warmed_tokens` / `warm_ids`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from proxy.record.kind import Kind
from proxy.record.outcome import Outcome
from proxy.report.model import Row, Table, quantile
from proxy.report.records import RecordLine, is_turn, new_tokens, num

OUTCOMES = (Outcome.DONE, Outcome.SUPERSEDED, Outcome.EXPIRED, Outcome.CANCELLED, Outcome.FAILED)


def warm_table(records: Sequence[RecordLine], cold_tokens: int) -> Table:
    """`cold_tokens`: a turn not warmed that computed at least this many prompt tokens is cold."""
    warm = [r for r in records if r.get("kind") == Kind.WARM]
    computed = [r for r in warm if (num(r, "fed_tokens") or 0) > 0]
    turns = [r for r in records if is_turn(r)]
    warmed = [r for r in turns if (num(r, "warmed_tokens") or 0) > 0]
    found = {str(i) for r in warmed for i in (r.get("warm_ids") or ())}
    hits = [r for r in computed if str(r.get("id")) in found]
    cold = [r for r in turns if not (num(r, "warmed_tokens") or 0)
            and (new_tokens(r) or 0) >= cold_tokens]
    outcomes = Counter(str(r.get("outcome")) for r in warm)
    rows = [Row("warm-ups", len(warm), (None, _sum(warm, "fed_tokens"), None, None))]
    for outcome in (*OUTCOMES, *sorted(set(outcomes) - set(OUTCOMES))):
        group = [r for r in warm if r.get("outcome") == outcome]
        if group:
            rows.append(Row(f"  {outcome}", len(group),
                            (_share(len(group), len(warm)), _sum(group, "fed_tokens"), None, None)))
    rows += [
        Row("found by a later turn (hits)", len(hits),
            (_share(len(hits), len(computed)), _sum(warmed, "warmed_tokens"), None, None)),
        Row("warmed turns", len(warmed), (None, _sum(warmed, "warmed_tokens"), *_ttft(warmed))),
        Row(f"cold turns (not warmed, >= {cold_tokens:,} new tokens)", len(cold),
            (None, sum(new_tokens(r) or 0 for r in cold), *_ttft(cold))),
    ]
    return Table(
        "warm",
        "Warm-ups: what they computed, and the turns that found it",
        ("share", "tokens", "median TTFT", "p90 TTFT"),
        ("%", "tok", "s", "s"),
        tuple(rows),
        note=("hit rate: the share of warm-ups that computed tokens whose work a later turn of the "
              "same conversation was credited with; tokens: computed (warm-ups), credited "
              "(warmed_tokens), computed by the turn itself (cold)"),
        n_label="count",
    )


def _sum(records: Sequence[RecordLine], key: str) -> float:
    return sum(num(r, key) or 0.0 for r in records)


def _share(part: int, whole: int) -> float | None:
    return 100.0 * part / whole if whole else None


def _ttft(records: Sequence[RecordLine]) -> tuple[float | None, float | None]:
    values = [t / 1000.0 for r in records if (t := num(r, "ttft_ms")) is not None]
    return quantile(values, 0.5), quantile(values, 0.9)
