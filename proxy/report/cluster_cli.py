"""`slotwise report LOG LOG ...` and `slotwise analyze-log SERVER_LOG SERVER_LOG ...`: one log per
node. Reads the logs and assembles the reports (the cli module prints them): first the nodes
together (the node table), then each node's own report.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.report.model import Report, Span
from proxy.report.nodes import group_by_node, log_name, node_of, nodes_table, spans_nodes_table
from proxy.report.pairing import pair
from proxy.report.record_tables import requests_table
from proxy.report.records import InputError, LoadedTimingLog, RecordLine, load_timing_log, select
from proxy.report.reports import server_report, timing_report
from proxy.report.serverlog import ParsedLog
from proxy.report.tables import Thresholds
from proxy.report.tasks import rebuild_tasks, task_to_span

ALL = "all nodes"


def timing_reports(paths: Sequence[str], since: float | None, until: float | None,
                   th: Thresholds) -> tuple[list[Report], list[str], dict[str, list[RecordLine]]]:
    """The reports over several timing logs, their names, and each node's records."""
    logs = [load_timing_log(path) for path in paths]
    named = [(log_name(log.path, paths), select(log.records, since, until)) for log in logs]
    groups = group_by_node(named)
    came_from: dict[str, set[int]] = {}
    for i, (name, records) in enumerate(named):
        for record in records:
            came_from.setdefault(node_of(record, name), set()).add(i)
    everything = [r for records in groups.values() for r in records]
    sources = ", ".join(paths)
    summary = Report(f"{len(groups)} nodes: {sources}", (nodes_table(groups), requests_table(everything)),
                     _bad_lines(logs))
    reports, names = [summary], [ALL]
    for node, records in groups.items():
        (source,) = [logs[i] for i in came_from[node]] if len(came_from[node]) == 1 else [None]
        reports.append(timing_report(f"node {node}", records, source, th))
        names.append(node)
    return reports, names, groups


def _bad_lines(logs: Sequence[LoadedTimingLog]) -> tuple[str, ...]:
    return tuple(f"{log.path}: {len(log.bad_lines)} of {log.lines} lines are not timing records "
                 "and were skipped" for log in logs if log.bad_lines)


def server_reports(paths: Sequence[str], parsed: Sequence[ParsedLog], timings: Sequence[str],
                   th: Thresholds) -> tuple[list[Report], list[str], dict[str, list[Span]]]:
    """The reports over several llama-server logs (one per node), each paired with its timing log
    when `timings` gives one per server log, in the same order."""
    if timings and len(timings) != len(paths):
        raise InputError(f"--timing: give one timing log per server log, in the same order "
                         f"({len(paths)} server logs, {len(timings)} timing logs)")
    groups: dict[str, list[Span]] = {}
    reports: list[Report] = []
    for i, (path, log) in enumerate(zip(paths, parsed, strict=True)):
        tasks = rebuild_tasks(log.events)
        name, note = log_name(path, paths), None
        if timings:
            timing = load_timing_log(timings[i])
            spans, paired, _offset = pair(tasks, timing.records)
            name = _node_name(timing) or name
            note = f"paired {paired} of {len(tasks)} server tasks with {len(timing.records)} timing records"
        else:
            spans = [s for t in tasks if (s := task_to_span(t)) is not None]
        groups[name] = list(spans)
        reports.append(server_report(f"node {name}: {path}", log, tasks, spans, th, note))
    summary = Report(f"{len(paths)} nodes: {', '.join(paths)}", (spans_nodes_table(groups),))
    return [summary, *reports], [ALL, *groups], groups


def _node_name(log: LoadedTimingLog) -> str | None:
    names = {r.get("node") for r in log.records if isinstance(r.get("node"), str)}
    return names.pop() if len(names) == 1 else None
