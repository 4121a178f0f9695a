"""The figures a what-if is checked by (issue 21), from any timing log, and a prediction against a
measured run of the same workload: the cold requests' time to first token, the streams' rate and
longest gap while a cold prompt is computed, short turns' p90 time to first token. Pure.

Logs of the same scripted day (`bench day` names its requests) are compared over the requests both
have: the measured day may end before a request the recorded one played, or play one more, and
over twenty short turns one request more or less moves the p90 to another rank. And each request
counts in the prediction as the measured log counts it (cold, short, or neither): a request near
a threshold can compute a few hundred tokens more or less in the model (a warm-up that got further,
a cache hit), and counted apart the two logs' figures would be over other requests (a slotwise
day: the one slow cold window of three, `ann-5`'s, computed 1,583 tokens measured and 1,199 in the
model, and the rate over the other two read +71 % where the same three read +4 %). A request the
measured log could not size (its client left, or the recording ended, before llama-server said
its sizes) is never cold: it counts among the short turns in both. The streams' rate and longest
gap are taken over the cold requests both logs had a stream beside (`streamed_beside`). Logs with
other ids are compared whole, each counting its own.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from proxy.record.timing import percentile
from proxy.report.records import COMPLETION_KINDS, RecordLine, is_turn, new_tokens, num

SHORT_TOKENS = 1000
"""A short turn computes fewer new prompt tokens than this (the field report's definition)."""
SHARED_IDS = 0.5
"""Two logs whose generation requests share at least this share of the measured one's ids are the
same day's (compared over the shared ones)."""
MIN_BESIDE_MS = 300.0
"""Streams that decoded less than this in all in a cold request's window were not beside it (`bench
contention`'s floor for a rate, pooled alike): one token at the window's edge, 0.1 ms before the
cold request's first, read as 10,000 tokens a second."""
FIGURES = (
    ("cold_ttft_s", "cold requests' time to first token (s, median)"),
    ("stream_rate", "streams' rate while a cold prompt is computed (tok/s)"),
    ("stream_gap_s", "streams' longest gap while a cold prompt is computed (s)"),
    ("short_ttft_p90_s", "short turns' time to first token (s, p90)"),
)


class Kind(enum.Enum):
    COLD = "cold"
    SHORT = "short"
    BETWEEN = "between"
    """Neither: a turn of at least SHORT_TOKENS and under `cold_tokens` new tokens."""


def counted(records: Sequence[RecordLine], cold_tokens: int) -> dict[str, Kind]:
    """Each generation request's kind by its new tokens; one this log could not size is short
    (it is never cold: its size is unknown)."""
    kinds = {}
    for r in records:
        if r.get("kind") not in COMPLETION_KINDS:
            continue
        new = new_tokens(r)
        kinds[str(r.get("id"))] = (Kind.SHORT if new is None or new < SHORT_TOKENS
                                   else Kind.COLD if new >= cold_tokens else Kind.BETWEEN)
    return kinds


def cold_ids(kinds: Mapping[str, Kind]) -> list[str]:
    """The requests `kinds` counts as cold."""
    return [i for i, kind in kinds.items() if kind is Kind.COLD]


def figures(records: Sequence[RecordLine], cold_tokens: int = 2000,
            kinds: Mapping[str, Kind] | None = None,
            beside_of: Collection[str] | None = None) -> dict[str, float | None]:
    """`kinds`: how another log counts each request (`counted`); these count the same way,
    whatever sizes this log knows. Without: as this log counts them. `beside_of`: the cold
    requests whose windows the streams' figures are taken over (None: every one's)."""
    kinds = counted(records, cold_tokens) if kinds is None else kinds
    cold = {str(r.get("id")): r for r in records
            if is_turn(r) and kinds.get(str(r.get("id"))) is Kind.COLD}
    ttfts = [t / 1000.0 for r in cold.values() if (t := num(r, "ttft_ms")) is not None]
    beside = [w for i, w in windows(records, cold).items() if beside_of is None or i in beside_of]
    events, ms = sum(w.events for w in beside), sum(w.ms for w in beside)
    gaps = [w.gap_s for w in beside if w.gap_s is not None]
    short = sorted(t / 1000.0 for r in records if kinds.get(str(r.get("id"))) is Kind.SHORT
                   and (t := _first_token_ms(r)) is not None)
    return {
        "cold_ttft_s": statistics.median(ttfts) if ttfts else None,
        "stream_rate": events / (ms / 1000.0) if ms > 0 else None,
        "stream_gap_s": max(gaps) if gaps else None,
        "short_ttft_p90_s": percentile(short, 90) if short else None,
    }


@dataclass(frozen=True)
class Window:
    """What the streams got while one cold prompt was computed: the tokens they generated, the
    time they decoded in its window, and the longest gap of any of their replies."""

    events: float = 0.0
    ms: float = 0.0
    gap_s: float | None = None


def windows(records: Sequence[RecordLine], cold: Collection[str]) -> dict[str, Window]:
    """Each cold request's window, from the overlaps of the turns that decoded in it, where they
    decoded `MIN_BESIDE_MS` or more in all."""
    out: dict[str, Window] = {}
    for record in records:
        if not is_turn(record):
            continue
        gap = num(record, "gap_max_ms")
        for ov in record.get("overlaps") or ():
            if not isinstance(ov, Mapping) or str(ov.get("id")) not in cold:
                continue
            events, ms = num(ov, "decode_events") or 0.0, num(ov, "decode_ms") or 0.0
            if events <= 0:
                continue
            was = out.get(str(ov.get("id")), Window())
            gaps = [g for g in (was.gap_s, None if gap is None else gap / 1000.0) if g is not None]
            out[str(ov.get("id"))] = Window(was.events + events, was.ms + ms,
                                            max(gaps, default=None))
    return {cold_id: w for cold_id, w in out.items() if w.ms >= MIN_BESIDE_MS}


@dataclass(frozen=True)
class ColdRequest:
    """One cold request in the prediction and in the measured run (None where a log lacks it)."""

    req_id: str
    new_tokens: tuple[float | None, float | None]
    ttft_s: tuple[float | None, float | None]
    beside: tuple[Window | None, Window | None]


def cold_requests(predicted: Sequence[RecordLine], measured: Sequence[RecordLine],
                  cold_tokens: int = 2000) -> list[ColdRequest]:
    """The cold requests of one day's two logs, as the measured run counts them, side by side:
    what `compare`'s first two figures are made of."""
    cold = cold_ids(counted(measured, cold_tokens))
    logs = [{str(r.get("id")): r for r in log if is_turn(r)} for log in (predicted, measured)]
    beside = [windows(log, cold) for log in (predicted, measured)]
    out = []
    for req_id in cold:
        found = [log.get(req_id) for log in logs]
        ttfts = [None if r is None or (t := num(r, "ttft_ms")) is None else t / 1000.0
                 for r in found]
        out.append(ColdRequest(
            req_id, (_new(found[0]), _new(found[1])), (ttfts[0], ttfts[1]),
            (beside[0].get(req_id), beside[1].get(req_id))))
    return out


def slowest_short(predicted: Sequence[RecordLine], measured: Sequence[RecordLine],
                  cold_tokens: int = 2000, n: int = 3) -> list[tuple[str, float | None, float | None]]:
    """The short turns among the `n` latest first tokens of either of one day's two logs (what the
    p90 rests on), latest first, each with its first token predicted and measured, in seconds."""
    kinds = counted(measured, cold_tokens)
    firsts = [{str(r.get("id")): t / 1000.0 for r in log
               if kinds.get(str(r.get("id"))) is Kind.SHORT
               and (t := _first_token_ms(r)) is not None} for log in (predicted, measured)]
    latest = {i for log in firsts for i in sorted(log, key=log.__getitem__, reverse=True)[:n]}
    rows = [(i, firsts[0].get(i), firsts[1].get(i)) for i in latest]
    return sorted(rows, key=lambda row: max(t for t in row[1:] if t is not None), reverse=True)


def _new(record: RecordLine | None) -> float | None:
    return None if record is None else new_tokens(record)


def _first_token_ms(record: RecordLine) -> float | None:
    """A generation request's time to first token, also when its client left after it; one whose
    client left before it came counts with the time it waited (at least that long): dropping it
    would make a day of starved requests look better than one where they got their token late."""
    if record.get("kind") not in COMPLETION_KINDS:
        return None
    ttft = num(record, "ttft_ms")
    if ttft is None and record.get("outcome") == "client_gone":
        return num(record, "total_ms")
    return ttft if record.get("outcome") in ("done", "client_gone") else None


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    predicted: float | None
    measured: float | None

    @property
    def error(self) -> float | None:
        if self.predicted is None or self.measured is None or self.measured == 0:
            return None
        return self.predicted / self.measured - 1.0

    def within(self, tolerance: float) -> bool | None:
        error = self.error
        return None if error is None else abs(error) <= tolerance + 1e-9


def compare(predicted: Sequence[RecordLine], measured: Sequence[RecordLine],
            cold_tokens: int = 2000) -> list[Row]:
    both = shared(predicted, measured)
    kinds, beside_of = None, None
    if both is not None:
        predicted = [r for r in predicted if str(r.get("id")) in both]
        measured = [r for r in measured if str(r.get("id")) in both]
        kinds = counted(measured, cold_tokens)
        beside_of = streamed_beside(predicted, measured, kinds)
    p = figures(predicted, cold_tokens, kinds, beside_of)
    m = figures(measured, cold_tokens, kinds, beside_of)
    return [Row(key, label, p[key], m[key]) for key, label in FIGURES]


def streamed_beside(predicted: Sequence[RecordLine], measured: Sequence[RecordLine],
                    kinds: Mapping[str, Kind]) -> set[str]:
    """The cold requests (as `kinds`, the measured run's, counts them) that had a stream generating beside
    them in both of one day's logs: the streams' rate and gap are compared over these windows.
    In a window where one log has nobody streaming, the other's streams were there at another
    moment of the day (a reply started a few seconds sooner or later); pooled in, one such window
    decides the rate (a `-b 512` prediction: a LoRA client's reply running alone at 127 tokens a
    second beside `bob-6`, who had nobody beside him measured, read +478 % where the three
    windows both logs have read +8 %)."""
    cold = cold_ids(kinds)
    return set(windows(predicted, cold)) & set(windows(measured, cold))


def shared(predicted: Sequence[RecordLine], measured: Sequence[RecordLine]) -> set[str] | None:
    """The ids `compare` takes from each log when the two are one day's (None: each whole)."""
    both = _ids(predicted) & _ids(measured)
    return both if len(both) >= SHARED_IDS * len(_ids(measured)) else None


def _ids(records: Sequence[RecordLine]) -> set[str]:
    return {str(r.get("id")) for r in records if r.get("kind") in COMPLETION_KINDS}


def passed(rows: Sequence[Row], tolerance: float) -> bool:
    """Every figure both logs have is within the tolerance (and at least one is)."""
    verdicts = [row.within(tolerance) for row in rows]
    known = [v for v in verdicts if v is not None]
    return bool(known) and all(known)


def show(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.3g}"
