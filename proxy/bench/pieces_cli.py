"""`slotwise bench pieces`: runs `proxy.bench.pieces` on the testbed or on the upstream of a
slotwise config and prints the batch time of each piece size beside a short turn's own prompt time,
then the batch-cost model fitted from them, what `chunk` would do with it, and the layout advice.
Only this module knows about terminals."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from proxy.bench.contention import SERVER_ARGS
from proxy.bench.harness import temp_dir
from proxy.bench.output import figures_table, print_table, show
from proxy.bench.pieces import (
    COLD_REST,
    SIZES,
    PieceFigures,
    PrefixOutlook,
    costs_toml,
    fit_pieces,
    measure,
    outlooks,
    server_layout,
)
from proxy.config import ConfigError, PrefillConfig, load_config
from proxy.prefill.cost_fit import CostFit
from proxy.prefill.layout import ServerLayout, layout_advice
from proxy.prefill.outlook import ChunkKnobs
from proxy.testbed.model import write_model
from proxy.testbed.server import LlamaServer


def add_pieces(commands: Any) -> None:
    pieces = commands.add_parser(
        "pieces", help="what one piece of a fed cold prompt costs: batch time by piece size")
    pieces.add_argument("--config", metavar="FILE",
                        help="measure the upstream of this slotwise config (its url and API key; "
                             "it needs streams + 2 free slots); default: the testbed's small model")
    pieces.add_argument("--prefix", default="3000",
                        help="tokens cached before the pieces; several, comma-separated, measure "
                             "each in turn and let the fit tell the context's part (e.g. "
                             "300,3000,6000; default 3000)")
    pieces.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help=f"piece sizes in tokens, comma-separated (default {','.join(map(str, SIZES))})")
    pieces.add_argument("--streams", type=int, default=3,
                        help="completions decoding meanwhile (default 3)")
    pieces.add_argument("--server-args", default=" ".join(SERVER_ARGS),
                        help="the testbed llama-server's flags (default "
                             f"{' '.join(SERVER_ARGS)!r}); not with --config")
    pieces.add_argument("--json", action="store_true", help="also print the figures as JSON")
    pieces.add_argument("--costs-out", metavar="FILE",
                        help="write the pieces as a `slotwise whatif --costs` file: the what-if "
                             "fits them with its log's prompts, which cannot price small pieces "
                             "after a long prefix on their own")
    pieces.set_defaults(handler=run_pieces)


def run_pieces(args: argparse.Namespace) -> int:
    sizes, prefixes = _numbers(args.sizes, "--sizes"), _numbers(args.prefix, "--prefix")
    if sizes is None or prefixes is None:
        return 2
    if not sizes or min(sizes) < 1 or not prefixes or min(prefixes) < 1 or args.streams < 0:
        print("slotwise: --sizes and --prefix need at least one number >= 1 each, --streams must "
              "be >= 0", file=sys.stderr)
        return 2
    if args.costs_out:  # before minutes of measuring, not after
        try:
            Path(args.costs_out).touch()
        except OSError as exc:
            print(f"slotwise: cannot write {args.costs_out}: {exc.strerror}", file=sys.stderr)
            return 2
    prefill = PrefillConfig()
    console = Console(stderr=True)
    with contextlib.ExitStack() as stack:
        if args.config:
            try:
                config = load_config(args.config)
            except (OSError, ConfigError) as exc:
                print(f"slotwise: {exc}", file=sys.stderr)
                return 2
            upstream, prefill = config.upstream, config.prefill
            url, headers, where = upstream.url, upstream.auth_headers(), upstream.url
        else:
            console.print("[dim]starting llama-server (testbed small model) …[/dim]")
            work = temp_dir("slotwise-pieces-")
            model = write_model(work / "model", "small", seed=0)
            server = stack.enter_context(LlamaServer(
                model.model, args=args.server_args.split(), log_path=work / "llama-server.log"))
            url, headers, where = server.url, {}, "testbed small model"
        figures = PieceFigures(streams=args.streams)
        for prefix in prefixes:
            figures.extend(asyncio.run(measure(url, prefix=prefix, sizes=sizes,
                                               streams=args.streams, headers=headers)))
        layout = asyncio.run(server_layout(url, headers))
    fitted = fit_pieces(figures)
    knobs = ChunkKnobs(max_stall_ms=prefill.max_stall_ms, n_batch=prefill.n_batch,
                       prefill_share=prefill.prefill_share, max_hold_ms=prefill.max_hold_s * 1000.0)
    seen = outlooks(fitted, prefixes, args.streams, knobs)
    status = show(pieces_table(figures, where), {
        **figures.as_dict(), "fit": fitted.cost.__dict__,
        "outlooks": [{"prefix": o.prefix, "fitting_piece": o.fitting_piece,
                      "strategy": o.choice.strategy.value, "piece_tokens": o.choice.piece_tokens,
                      "reason": o.choice.reason} for o in seen],
        "layout_advice": layout_advice("chunk", layout)}, as_json=args.json)
    if args.costs_out:
        try:
            Path(args.costs_out).write_text(costs_toml(figures, where, args.server_args
                                                       if not args.config else None),
                                            encoding="utf-8")
        except OSError as exc:
            print(f"slotwise: cannot write {args.costs_out}: {exc.strerror}", file=sys.stderr)
            return 2
    print_table(fit_table(fitted.describe(), seen, knobs))
    for line in advice_lines(layout):
        print(line)
    return status


def _numbers(text: str, flag: str) -> list[int] | None:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        print(f"slotwise: {flag} must be whole numbers separated by commas, got {text!r}",
              file=sys.stderr)
        return None


def fit_table(fit: CostFit, seen: list[PrefixOutlook], knobs: ChunkKnobs) -> Table:
    """The fitted model in one line (the title), then per prefix what `chunk` would make of it."""
    table = figures_table(f"fitted: {fit.summary()}")
    for column in ("after prefix", f"largest piece within {knobs.max_stall_ms:g} ms",
                   f"chunk's way on for {COLD_REST:,} more tokens"):
        table.add_column(column, justify="left" if column.startswith("chunk") else "right")
    for o in seen:
        table.add_row(f"{o.prefix:,}", f"{o.fitting_piece} tokens (~{o.fitting_ms:.0f} ms)",
                      o.choice.reason)
    table.caption = ("a fit from pieces of a few sizes after one prefix cannot tell the context's "
                     "part from the attention's: measure several (--prefix 300,3000,6000)")
    return table


def advice_lines(layout: ServerLayout) -> list[str]:
    """The server's layout and the flags that would serve `chunk` better, as `serve` warns them."""
    advice = layout_advice("chunk", layout)
    head = f"llama-server: {layout.describe()}"
    if not advice:
        return [f"{head}; nothing in its layout costs chunk a lot that slotwise can see "
                "(it cannot see --cache-idle-slots: run --no-cache-idle-slots, docs/prefill.md)"]
    return [f"{head}. Flags:"] + [f"  - {a}" for a in advice]


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
