"""Reports over several nodes (docs/scale-out.md): one timing log or llama-server log per node, a
request in exactly one of them. Pure: groups records by node and makes the node table; the
per-node tables are the single-node reports, each over its own node's records (another node's
requests never contend with this node's, so they are never mixed on one time axis).

A record names its node (`node`, since slotwise wrote it); an older record gets the name of the
log it came from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from proxy.record.refusals import requests_in
from proxy.report.model import Row, Span, Table, quantile
from proxy.report.records import RecordLine, is_turn, num, prompt_split


def log_name(path: str, paths: Sequence[str]) -> str:
    """A short name for a log among `paths`: its file name, or its folder when those are alike."""
    p = Path(path)
    names = [Path(q).name for q in paths]
    return p.name if names.count(p.name) == 1 else f"{p.parent.name}/{p.name}"


def node_of(record: RecordLine, fallback: str) -> str:
    node = record.get("node")
    return node if isinstance(node, str) and node else fallback


def group_by_node(logs: Sequence[tuple[str, Sequence[RecordLine]]]) -> dict[str, list[RecordLine]]:
    """Records of every log by node name, in the order the nodes first appear."""
    groups: dict[str, list[RecordLine]] = {}
    for name, records in logs:
        for record in records:
            groups.setdefault(node_of(record, name), []).append(record)
    return groups


def nodes_table(groups: Mapping[str, Sequence[RecordLine]]) -> Table:
    """One row per node: its requests, turns, errors, time to first token and prompt tokens."""
    rows = [_node_row(name, records) for name, records in groups.items()]
    everything = [r for records in groups.values() for r in records]
    rows.append(_node_row("all nodes", everything))
    return Table(
        "nodes", "Requests by node (each request is in exactly one node's log)",
        ("turns", "not done", "TTFT p50", "TTFT p95", "computed", "cached"),
        ("", "", "ms", "ms", "tok", "%"), tuple(rows), n_label="requests",
        note="computed: prompt tokens the node's server computed; cached: share of the turns' "
             "prompt tokens it found in its cache")


def _node_row(label: str, records: Sequence[RecordLine]) -> Row:
    turns = [r for r in records if is_turn(r)]
    ttfts = [v for r in turns if (v := num(r, "ttft_ms")) is not None]
    computed = cached = 0
    for record in turns:
        prompt_n, cache_n = prompt_split(record)
        computed += prompt_n or 0
        cached += cache_n or 0
    outcomes: Counter[str] = Counter()
    for record in records:  # a summary of refusals stands for its `refused_count` requests
        outcomes[str(record.get("outcome"))] += requests_in(record)
    requests = outcomes.total()
    share = 100.0 * cached / (computed + cached) if computed + cached else None
    return Row(label, requests, (float(len(turns)), float(requests - outcomes["done"]),
                                     quantile(ttfts, 0.5), quantile(ttfts, 0.95), float(computed),
                                     share))


def spans_nodes_table(groups: Mapping[str, Sequence[Span]]) -> Table:
    """`analyze-log` over several servers: one row per node's rebuilt tasks (or paired spans)."""
    rows = [_spans_row(name, spans) for name, spans in groups.items()]
    rows.append(_spans_row("all nodes", [s for spans in groups.values() for s in spans]))
    return Table(
        "nodes", "Server tasks by node (one llama-server log per node)",
        ("TTFT p50", "TTFT p95", "computed", "cached"), ("ms", "ms", "tok", "%"), tuple(rows),
        n_label="tasks", note="TTFT from the task's start (or the paired request's arrival)")


def _spans_row(label: str, spans: Sequence[Span]) -> Row:
    ttfts = [t * 1000.0 for s in spans if (t := s.ttft_s) is not None]
    computed = sum(s.prompt_n or 0 for s in spans)
    cached = sum(s.cached_n or 0 for s in spans)
    share = 100.0 * cached / (computed + cached) if computed + cached else None
    return Row(label, len(spans), (quantile(ttfts, 0.5), quantile(ttfts, 0.95), float(computed),
                                   share))
