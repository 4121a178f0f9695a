"""`slotwise bench …`: the benchmarks, each printing its figures beside their baselines."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from proxy.bench.cluster import add_cluster
from proxy.bench.contention_cli import add_contention
from proxy.bench.day_cli import add_day
from proxy.bench.keep import add_keep
from proxy.bench.kv import add_kv
from proxy.bench.output import figures_table, show
from proxy.bench.pieces_cli import add_pieces
from proxy.bench.soak_cli import add_soak
from proxy.bench.warm_cli import add_warm
from proxy.testbed.args import positive_int

if TYPE_CHECKING:
    from proxy.bench.overhead import OverheadFigures


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="measure slotwise against a real llama-server")
    commands = bench.add_subparsers(dest="bench", metavar="BENCH")
    bench.set_defaults(handler=lambda args: _usage(bench))
    overhead = commands.add_parser(
        "overhead", help="time to first token and relay rate, direct versus through slotwise")
    overhead.add_argument("--pairs", type=positive_int, default=40,
                          help="requests per path for time to first token (default 40)")
    overhead.add_argument("--streams", type=positive_int, default=8,
                          help="concurrent streams for the relay rate (default 8)")
    overhead.add_argument("--tokens", type=positive_int, default=1500,
                          help="tokens per stream for the relay rate (default 1500)")
    overhead.add_argument("--against", metavar="REV",
                          help="instead of direct, compare with slotwise at this git revision "
                               "(a worktree of it), side by side in one run")
    overhead.add_argument("--json", action="store_true", help="also print the figures as JSON")
    overhead.set_defaults(handler=run_overhead)
    add_pieces(commands)
    add_contention(commands)
    add_soak(commands)
    add_cluster(commands)
    add_warm(commands)
    add_keep(commands)
    add_day(commands)
    add_kv(commands)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def run_overhead(args: argparse.Namespace) -> int:
    from proxy.bench.overhead import run

    console = Console(stderr=True)
    if args.against:
        return run_versions(args, console)
    console.print("[dim]starting llama-server (testbed tiny model) and slotwise …[/dim]")
    figures = run(pairs=args.pairs, streams=args.streams, tokens=args.tokens)
    return show(overhead_table(figures), figures.as_dict(), as_json=args.json)


def overhead_table(figures: OverheadFigures) -> Table:
    table = figures_table("slotwise overhead (testbed tiny model, one run)")
    table.add_column("figure")
    table.add_column("direct", justify="right")
    table.add_column("via slotwise", justify="right")
    table.add_column("difference")
    table.add_row("time to first token, median", f"{figures.ttft_direct_ms:.2f} ms",
                  f"{figures.ttft_proxy_ms:.2f} ms",
                  f"+{figures.ttft_added_ms:.2f} ms (aim < 2 ms)")
    table.add_row("stream events / s (wall)", f"{figures.rate_direct:,.0f}",
                  f"{figures.rate_proxy:,.0f}",
                  f"ratio {figures.rate_proxy / figures.rate_direct:.3f}")
    table.add_row("relay capacity, events / CPU-second", "",
                  f"{figures.events_per_cpu_s:,.0f}",
                  f"{figures.events_relayed:,} events in {figures.proxy_cpu_s:.2f} s CPU "
                  "(aim ≥ 5,000)")
    return table


def run_versions(args: argparse.Namespace, console: Console) -> int:
    from proxy.bench.versions import VersionError, run_against

    console.print(f"[dim]starting llama-server, this slotwise and slotwise at {args.against} …[/dim]")
    try:
        result = run_against(args.against, pairs=args.pairs, streams=args.streams,
                             tokens=args.tokens)
    except VersionError as exc:
        print(f"slotwise: {exc}", file=sys.stderr)
        return 2
    table = figures_table(f"this checkout against {args.against} (testbed tiny model, one run)")
    for column in ("figure", "this checkout", args.against, "difference"):
        table.add_column(column, justify="left" if column in ("figure", "difference") else "right")
    table.add_row("time to first token, median", f"{result.here.ttft_ms:.2f} ms",
                  f"{result.there.ttft_ms:.2f} ms", f"{result.ttft_added_ms:+.2f} ms (paired)")
    table.add_row("relay capacity, events / CPU-second", f"{result.here.events_per_cpu_s:,.0f}",
                  f"{result.there.events_per_cpu_s:,.0f}",
                  f"ratio {result.here.events_per_cpu_s / result.there.events_per_cpu_s:.3f}"
                  if result.there.events_per_cpu_s else "")
    return show(table, result.as_dict(), as_json=args.json)
