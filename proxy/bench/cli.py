"""`slotwise bench …`: the benchmarks, each printing its figures beside their baselines."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table


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
    from proxy.bench.pieces_cli import add_pieces

    add_pieces(commands)
    try:
        from proxy.bench.contention_cli import add_contention
    except ModuleNotFoundError as exc:
        if exc.name != "proxy.bench.contention_cli":
            raise
    else:
        add_contention(commands)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def run_overhead(args: argparse.Namespace) -> int:
    from proxy.bench.overhead import run

    console = Console(stderr=True)
    console.print("[dim]starting llama-server (testbed tiny model) and slotwise …[/dim]")
    figures = run(pairs=args.pairs, streams=args.streams, tokens=args.tokens)
    table = Table(title="slotwise overhead (testbed tiny model, one run)")
    for column in ("figure", "direct", "via slotwise", "difference"):
        table.add_column(column, justify="right" if column != "figure" else "left")
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
    return show(table, figures.as_dict(), as_json=args.json)


def show(table: Table, figures: dict[str, Any], *, as_json: bool) -> int:
    """Print a benchmark's table, and its figures as JSON if asked; the command's exit status."""
    Console().print(table)
    if as_json:
        print(orjson.dumps(figures, option=orjson.OPT_INDENT_2).decode())
    return 0

