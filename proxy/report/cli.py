"""The `report` and `analyze-log` subcommands: read inputs, call aggregation, pick a renderer.

Every bad input becomes a one-line error on stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.report import render, render_html
from proxy.report.cluster_cli import server_reports, timing_reports
from proxy.report.model import Report, Span
from proxy.report.pairing import pair
from proxy.report.records import (
    InputError,
    LoadedTimingLog,
    RecordLine,
    first_pieces,
    load_timing_log,
    parse_time,
    record_to_span,
    select,
)
from proxy.report.reports import server_report, timing_report
from proxy.report.serverlog import TASK_LINES, UNRECOGNISED, ParsedLog, parse_server_log
from proxy.report.tables import Thresholds
from proxy.report.tasks import rebuild_tasks, task_to_span
from proxy.report.timeline import layout
from proxy.report.timeline_html import timeline_html
from proxy.report.timeline_png import write_png

FORMATS = ("text", "markdown", "json", "html")


def register(subparsers: Any) -> None:
    rep = subparsers.add_parser("report", help="tables of the field report from a timing log")
    rep.add_argument("timing_log", nargs="*", metavar="TIMING_LOG",
                     help="a timing log; several (one per node behind a router): a node table, "
                     "then each node's report")
    rep.add_argument("--since", help="first arrival time to include (ISO 8601, UTC if no zone)")
    rep.add_argument("--until", help="arrival time to stop before (ISO 8601)")
    rep.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="two files, or two ranges SINCE..UNTIL of TIMING_LOG, side by side",
    )
    _common(rep)
    rep.add_argument("--min-stall", type=float, default=Thresholds().min_stall_s, metavar="SECONDS",
                     help="a stream's longest gap between tokens listed as a stall from this long "
                     "(default %(default)g)")
    rep.set_defaults(handler=run_report)
    ana = subparsers.add_parser("analyze-log", help="rebuild tasks from llama-server's log")
    ana.add_argument("server_log", nargs="+", metavar="SERVER_LOG",
                     help="llama-server's log; several: one per node, a node table first")
    ana.add_argument("--timing", metavar="TIMING_LOG", action="append", default=[],
                     help="pair tasks with slotwise's records (once per SERVER_LOG, same order)")
    _common(ana)
    ana.set_defaults(handler=run_analyze)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument("--timeline", metavar="FILE", help="also draw a timeline: FILE.html or FILE.png")
    d = Thresholds()
    p.add_argument(
        "--long-prefill",
        type=int,
        default=d.long_prefill,
        metavar="TOKENS",
        help=f"prefill size for the decode-rate comparison (default {d.long_prefill})",
    )
    p.add_argument(
        "--big-new",
        type=int,
        default=d.big_new,
        metavar="TOKENS",
        help=f"a large uncached prompt (default {d.big_new})",
    )
    p.add_argument(
        "--short-new",
        type=int,
        default=d.short_new,
        metavar="TOKENS",
        help=f"a short turn has fewer new tokens (default {d.short_new})",
    )
    p.add_argument("--min-wait", type=float, default=d.min_wait_s, metavar="SECONDS")


def _thresholds(args: argparse.Namespace) -> Thresholds:
    return Thresholds(
        big_new=args.big_new,
        long_prefill=args.long_prefill,
        short_new=args.short_new,
        min_wait_s=args.min_wait,
        # only `report` has it: llama-server's log tells no stream's gaps
        min_stall_s=getattr(args, "min_stall", Thresholds().min_stall_s),
    )


def _guard(name: str, args: argparse.Namespace, body: Any) -> int:
    try:
        if args.timeline and Path(args.timeline).suffix.lower() not in (".html", ".png"):
            raise InputError(f"--timeline: {args.timeline!r} must end in .html or .png")
        return int(body(args))
    except InputError as exc:
        print(f"slotwise {name}: error: {exc}", file=sys.stderr)
        return 1


def run_report(args: argparse.Namespace) -> int:
    return _guard("report", args, _report)


def run_analyze(args: argparse.Namespace) -> int:
    return _guard("analyze-log", args, _analyze)


def _bound(text: str | None, what: str) -> float | None:
    return None if not text else parse_time(text, what)


def _report(args: argparse.Namespace) -> int:
    th = _thresholds(args)
    since, until = _bound(args.since, "--since"), _bound(args.until, "--until")
    if len(args.timing_log) > 1:
        return _nodes_report(args, since, until, th)
    log = load_timing_log(args.timing_log[0]) if args.timing_log else None
    if args.compare is None:
        if log is None:
            raise InputError("give TIMING_LOG (or --compare BEFORE AFTER)")
        sides = [(log.path, select(log.records, since, until), log)]
    else:
        sides = [_side(spec, log, since, until) for spec in args.compare]
    names = ["before", "after"] if len(sides) == 2 else [sides[0][0]]
    titles = [
        f"{n} = {spec}" if len(sides) == 2 else spec for n, (spec, _r, _s) in zip(names, sides, strict=True)
    ]
    reports = [timing_report(t, recs, src, th) for t, (_n, recs, src) in zip(titles, sides, strict=True)]
    _emit(reports, names, args.format)
    if args.timeline:
        for i, (name, recs, src) in enumerate(sides):
            path = args.timeline if len(sides) == 1 else _suffixed(args.timeline, i)
            pieces = first_pieces(src.records if src is not None else recs)
            _draw([record_to_span(r, pieces) for r in recs], name, path, th)
    return 0


def _side(
    spec: str, log: LoadedTimingLog | None, since: float | None, until: float | None
) -> tuple[str, list[RecordLine], LoadedTimingLog]:
    if os.path.isfile(spec):
        other = load_timing_log(spec)
        return spec, select(other.records, since, until), other
    if ".." not in spec:
        raise InputError(f"--compare: {spec!r} is neither a file nor a time range SINCE..UNTIL")
    if log is None:
        raise InputError(f"--compare: the range {spec!r} needs TIMING_LOG")
    a, b = spec.split("..", 1)
    lo = _bound(a, "--compare") if a else since
    hi = _bound(b, "--compare") if b else until
    return spec, select(log.records, lo, hi), log


def _suffixed(path: str, i: int) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{'before' if i == 0 else 'after'}{p.suffix}"))


def _analyze(args: argparse.Namespace) -> int:
    th = _thresholds(args)
    if len(args.server_log) > 1:
        return _nodes_analyze(args, th)
    args.server_log, args.timing = args.server_log[0], (args.timing or [None])[-1]
    log = _read_server_log(args.server_log)
    tasks = rebuild_tasks(log.events)
    note = None
    if args.timing:
        timing = load_timing_log(args.timing)
        spans, paired, offset = pair(tasks, timing.records)
        note = f"paired {paired} of {len(tasks)} server tasks with {len(timing.records)} timing records" + (
            f" (server start = {offset:.3f} s Unix time)"
            if offset
            else ": no task matched a record by its token counts"
        )
    else:
        spans = [s for t in tasks if (s := task_to_span(t)) is not None]
    report = server_report(args.server_log, log, tasks, spans, th, note)
    _emit([report], [args.server_log], args.format)
    if args.timeline:
        _draw(spans, args.server_log, args.timeline, th)
    return 0


def _read_server_log(path: str) -> ParsedLog:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            log = parse_server_log(handle)
    except OSError as exc:
        raise InputError(f"cannot read server log {path}: {exc.strerror or exc}") from None
    if log.lines and log.stamped == 0:
        raise InputError(
            f"{path}: none of its {log.lines} lines starts with llama-server's timestamp prefix "
            "(e.g. '0.06.055.462 I slot launch_slot_: id  3 | task 0 | processing task'); "
            "was it written with --no-log-prefix or --no-log-timestamps, or by another program?"
        )
    if log.counts[UNRECOGNISED] > log.counts[TASK_LINES]:
        print(
            f"slotwise analyze-log: warning: {path}: most slot lines were not recognised; "
            "this llama-server build may log another format",
            file=sys.stderr,
        )
    return log


def _nodes_report(args: argparse.Namespace, since: float | None, until: float | None,
                  th: Thresholds) -> int:
    if args.compare is not None:
        raise InputError("--compare takes one TIMING_LOG (or none), not one per node")
    reports, names, groups = timing_reports(args.timing_log, since, until, th)
    _emit_nodes(reports, names, args.format)
    if args.timeline:
        for node, records in groups.items():
            pieces = first_pieces(records)
            _draw([record_to_span(r, pieces) for r in records], f"node {node}",
                  _with_node(args.timeline, node), th)
    return 0


def _nodes_analyze(args: argparse.Namespace, th: Thresholds) -> int:
    parsed = [_read_server_log(path) for path in args.server_log]
    reports, names, groups = server_reports(args.server_log, parsed, args.timing, th)
    _emit_nodes(reports, names, args.format)
    if args.timeline:
        for node, spans in groups.items():
            _draw(spans, f"node {node}", _with_node(args.timeline, node), th)
    return 0


def _emit_nodes(reports: Sequence[Report], names: Sequence[str], fmt: str) -> None:
    """The nodes together first, then every node's tables side by side (a column per node); JSON
    and HTML as one document."""
    if fmt in ("json", "html"):
        _emit(reports, names, fmt)
        return
    _emit(reports[:1], names[:1], fmt)
    _emit(reports[1:], names[1:], fmt)


def _with_node(path: str, node: str) -> str:
    p = Path(path)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
    return str(p.with_name(f"{p.stem}-{safe}{p.suffix}"))


def _emit(reports: Sequence[Report], names: Sequence[str], fmt: str) -> None:
    if fmt == "json":
        text = render.to_json(reports, names)
    elif fmt == "markdown":
        text = render.to_markdown(reports, names)
    elif fmt == "html":
        text = render_html.to_html(reports, names)
    else:
        # The terminal's width, or COLUMNS; piped without COLUMNS, wide enough for no label to wrap.
        width = shutil.get_terminal_size((140, 40)).columns
        text = render.to_text(reports, names, width=width, color=sys.stdout.isatty())
    sys.stdout.write(text)


def _draw(spans: Sequence[Span], title: str, path: str, th: Thresholds) -> None:
    tl = layout(spans, big_new=th.big_new)
    if path.lower().endswith(".png"):
        write_png(tl, title, path)
    else:
        try:
            Path(path).write_text(timeline_html(tl, title), encoding="utf-8")
        except OSError as exc:
            raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"timeline written to {path}", file=sys.stderr)
