"""`slotwise bench …`: the benchmarks, each printing its figures beside their baselines."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from proxy.bench.contention_cli import add_contention
from proxy.bench.output import figures_table, positive_int, show
from proxy.bench.pieces_cli import add_pieces

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
    overhead.add_argument("--json", action="store_true", help="also print the figures as JSON")
    overhead.set_defaults(handler=run_overhead)
    add_pieces(commands)
    add_contention(commands)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def run_overhead(args: argparse.Namespace) -> int:
    from proxy.bench.overhead import run

    console = Console(stderr=True)
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
