"""`slotwise bench pieces`: runs `proxy.bench.pieces` on the testbed or on the upstream of a
slotwise config and prints the batch time of each piece size beside a short turn's own prompt time.
Only this module knows about terminals."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from proxy.bench.contention import SERVER_ARGS
from proxy.bench.harness import temp_dir
from proxy.bench.output import figures_table, positive_int, show
from proxy.bench.pieces import SIZES, PieceFigures, measure
from proxy.config import ConfigError, load_config
from proxy.testbed.model import write_model
from proxy.testbed.server import LlamaServer


def add_pieces(commands: Any) -> None:
    pieces = commands.add_parser(
        "pieces", help="what one piece of a fed cold prompt costs: batch time by piece size")
    pieces.add_argument("--config", metavar="FILE",
                        help="measure the upstream of this slotwise config (its url and API key; "
                             "it needs streams + 2 free slots); default: the testbed's small model")
    pieces.add_argument("--prefix", type=positive_int, default=3000,
                        help="tokens cached before the pieces (default 3000)")
    pieces.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help=f"piece sizes in tokens, comma-separated (default {','.join(map(str, SIZES))})")
    pieces.add_argument("--streams", type=int, default=3,
                        help="completions decoding meanwhile (default 3)")
    pieces.add_argument("--server-args", default=" ".join(SERVER_ARGS),
                        help="the testbed llama-server's flags (default "
                             f"{' '.join(SERVER_ARGS)!r}); not with --config")
    pieces.add_argument("--json", action="store_true", help="also print the figures as JSON")
    pieces.set_defaults(handler=run_pieces)


def run_pieces(args: argparse.Namespace) -> int:
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        print(f"slotwise: --sizes must be whole numbers separated by commas, got {args.sizes!r}",
              file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1 or args.streams < 0:
        print("slotwise: --sizes needs at least one size >= 1, --streams must be >= 0",
              file=sys.stderr)
        return 2
    console = Console(stderr=True)
    with contextlib.ExitStack() as stack:
        if args.config:
            try:
                upstream = load_config(args.config).upstream
            except (OSError, ConfigError) as exc:
                print(f"slotwise: {exc}", file=sys.stderr)
                return 2
            url, headers, where = upstream.url, upstream.auth_headers(), upstream.url
        else:
            console.print("[dim]starting llama-server (testbed small model) …[/dim]")
            work = temp_dir("slotwise-pieces-")
            model = write_model(work / "model", "small", seed=0)
            server = stack.enter_context(LlamaServer(
                model.model, args=args.server_args.split(), log_path=work / "llama-server.log"))
            url, headers, where = server.url, {}, "testbed small model"
        figures = asyncio.run(measure(url, prefix=args.prefix, sizes=sizes,
                                      streams=args.streams, headers=headers))
    return show(pieces_table(figures, where), figures.as_dict(), as_json=args.json)


def pieces_table(figures: PieceFigures, where: str) -> Table:
    short = statistics.median(figures.short_prompt_ms)
    table = figures_table(f"one piece's batch, {figures.streams} streams decoding ({where})")
    for column in ("piece tokens", "after prefix", "batch (server) ms", "ms per token",
                   "sent → answered ms", "× a short turn's prompt"):
        table.add_column(column, justify="right")
    for p in figures.pieces:
        table.add_row(f"{p.tokens:,}", f"{p.prefix:,}", f"{p.prompt_ms:.1f}",
                      f"{p.prompt_ms / max(1, p.tokens):.2f}", f"{p.wall_ms:.1f}",
                      f"{p.prompt_ms / short:.1f} ×")
    table.caption = (f"a short turn's own prompt (same conditions, median of "
                     f"{len(figures.short_prompt_ms)}): {short:.1f} ms. A request arriving "
                     "during a piece waits for the rest of its batch.")
    return table
