"""`slotwise bench soak`: runs `proxy.bench.soak` and prints requests, records, the lost ones and the
slotwise process's memory at the start, middle and end. Only this module knows about terminals."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from proxy.bench.output import figures_table, show
from proxy.bench.soak import SoakFigures, run
from proxy.testbed.args import positive_int


def add_soak(commands: Any) -> None:
    soak = commands.add_parser(
        "soak", help="mixed traffic and faults against a fake llama-server: one record per "
                     "request, memory that levels off")
    soak.add_argument("--seconds", type=positive_int, default=300,
                      help="how long the traffic runs (default 300)")
    soak.add_argument("--clients", type=positive_int, default=12,
                      help="concurrent clients (default 12)")
    soak.add_argument("--json", action="store_true", help="also print the figures as JSON")
    soak.set_defaults(handler=run_soak)


def run_soak(args: argparse.Namespace) -> int:
    Console(stderr=True).print(f"[dim]soaking slotwise for {args.seconds} s with {args.clients} "
                               "clients and one long stream …[/dim]")
    figures = run(args.seconds, clients=args.clients)
    status = show(soak_table(figures), figures.as_dict(), as_json=args.json)
    return status if figures.lost == 0 and figures.unexpected_count == 0 else 1


def soak_table(figures: SoakFigures) -> Table:
    table = figures_table(f"slotwise soak ({figures.seconds:g} s, fake upstream)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("note")
    table.add_row("requests sent", f"{figures.sent:,}",
                  ", ".join(f"{k} {v:,}" for k, v in sorted(figures.requests.items())))
    table.add_row("records written", f"{figures.records:,}",
                  ", ".join(f"{k} {v:,}" for k, v in sorted(figures.outcomes.items())))
    table.add_row("lost", f"{figures.lost:,}", "aim 0: one record per request")
    table.add_row("silent sockets closed", f"{figures.silent_closed:,} of {figures.silent_sockets:,}",
                  "idle or dripping a request head: closed by listen.header_timeout_s")
    table.add_row("unexpected answers", f"{figures.unexpected_count:,}",
                  "; ".join(figures.unexpected[:3]))
    start, middle, end = (figures.rss_at(share) for share in (0.0, 0.5, 1.0))
    table.add_row("RSS start / middle / end", f"{start:.1f} / {middle:.1f} / {end:.1f} MB",
                  f"{end - middle:+.1f} MB over the second half (aim: levels off)")
    return table
