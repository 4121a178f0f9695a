"""Assembles the tables of each command into a `Report` (still pure: no printing here)."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.record.kind import Kind
from proxy.record.refusals import requests_in
from proxy.report import record_tables, tables, task_tables
from proxy.report.keep_table import keep_tables
from proxy.report.model import Report, Span, Table
from proxy.report.records import LoadedTimingLog, RecordLine, first_pieces, is_turn, record_to_span
from proxy.report.serverlog import UNRECOGNISED, ParsedLog
from proxy.report.spanindex import SpanIndex
from proxy.report.stall_table import stalls_table
from proxy.report.tables import Thresholds
from proxy.report.tasks import Task
from proxy.report.warm_table import warm_table


def timing_report(title: str, records: Sequence[RecordLine], log: LoadedTimingLog | None,
                  th: Thresholds) -> Report:
    pieces = first_pieces(log.records if log is not None else records)
    timed = [r for r in records if r.get("kind") != Kind.REFUSALS]  # a summary of refusals: no times
    spans = [record_to_span(r, pieces) for r in timed]
    index = SpanIndex(spans)
    # The ids of `inflight_at_start` may name requests outside the selected range.
    if log is not None:
        index.by_key.update({s.key: s for s in (record_to_span(r, pieces) for r in log.records
                                                if r.get("kind") != Kind.REFUSALS)})
    turns = [s for s, r in zip(spans, timed, strict=True) if is_turn(r)]
    untimed = sum(requests_in(r) for r in records) - len(timed)
    report_tables = (
        tables.overview_table(turns, index, untimed),
        tables.turns_table(turns, th),
        tables.time_split_table(turns, index),
        record_tables.decode_rate_table(records, th.long_prefill),
        tables.waits_table(spans, index, th),
        stalls_table(spans, index, th),
        tables.ttft_table(turns, index, th),
        tables.sources_table(spans, th),
        record_tables.requests_table(records),
        record_tables.policy_table(records),
        record_tables.notes_table(records),
        record_tables.estimate_table(records),
        *keep_tables(records),
        *warm_tables(records, th),
    )
    remarks = []
    if log is not None and log.bad_lines:
        shown = ", ".join(map(str, log.bad_lines[:5]))
        remarks.append(
            f"{log.path}: {len(log.bad_lines)} of {log.lines} lines are not timing "
            f"records and were skipped (lines {shown}{', ...' if len(log.bad_lines) > 5 else ''})"
        )
    if not records:
        remarks.append("no records in the selected range")
    old = sum(1 for r in records if r.get("pieces") and "fed_tokens" not in r)
    if old:
        remarks.append(
            f"{old} record(s) fed in pieces have no fed_tokens (written by an older slotwise): "
            "their new tokens count only timings.prompt_n, the rest after the pieces"
        )
    return Report(title, report_tables, tuple(remarks))


def warm_tables(records: Sequence[RecordLine], th: Thresholds) -> tuple[Table, ...]:
    """The warm-ups table, where the log has warm-ups (docs/warm.md)."""
    if not any(r.get("kind") == Kind.WARM or r.get("warmed_tokens") for r in records):
        return ()
    return (warm_table(records, th.short_new),)


def server_report(
    title: str,
    log: ParsedLog,
    tasks: Sequence[Task],
    spans: Sequence[Span],
    th: Thresholds,
    pairing_note: str | None,
) -> Report:
    index = SpanIndex(spans)
    finished = [t for t in tasks if t.end_s is not None]
    report_tables = (
        task_tables.lines_table(log, tasks),
        tables.overview_table(list(spans), index),
        tables.turns_table(spans, th),
        tables.time_split_table(spans, index),
        task_tables.tg3s_table(finished, th.long_prefill),
        task_tables.prefill_steps_table(finished),
        task_tables.slot_switch_table(tasks),
        tables.waits_table(spans, index, th),
        tables.ttft_table(spans, index, th),
    ) + ((tables.sources_table(spans, th),) if pairing_note else ())
    remarks = [f"unrecognised line {n}: {text}" for n, text in log.unrecognised]
    if log.counts[UNRECOGNISED] > len(log.unrecognised):
        remarks.append(f"... {log.counts[UNRECOGNISED] - len(log.unrecognised)} more unrecognised")
    if pairing_note:
        remarks.append(pairing_note)
    extra: dict[str, object] = {
        "tasks": [t.to_json() for t in tasks],
        "unrecognised_lines": log.counts[UNRECOGNISED],
        "line_counts": dict(log.counts),
    }
    return Report(title, report_tables, tuple(remarks), extra)
