"""`slotwise bench warm [--json]`: runs `proxy.bench.warm` and prints its figures beside their
baselines and the issue's aims. Only this module knows about terminals."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from proxy.bench.contention import SERVER_ARGS
from proxy.bench.harness import temp_dir
from proxy.bench.output import figures_table, percent, seconds, show
from proxy.bench.warm import WarmFigures, WarmScenario, measure
from proxy.testbed.args import positive_int


def add_warm(commands: Any) -> None:
    cmd = commands.add_parser(
        "warm", help="a history warmed before its turn: the turn's wait, and the others' cost")
    d = WarmScenario()
    cmd.add_argument("--preset", choices=("tiny", "small"), default=d.preset,
                     help=f"testbed model (default {d.preset})")
    cmd.add_argument("--history-words", type=positive_int, default=d.history_words,
                     help=f"the history's size in words (default {d.history_words}, about 3,300 tokens)")
    cmd.add_argument("--streams", type=positive_int, default=d.streams,
                     help=f"streams generating in the streams phases (default {d.streams})")
    cmd.add_argument("--stream-tokens", type=positive_int, default=d.stream_tokens,
                     help=f"tokens each stream generates (default {d.stream_tokens})")
    cmd.add_argument("--server-args", default=" ".join(SERVER_ARGS),
                     help=f"llama-server flags of every phase (default {' '.join(SERVER_ARGS)!r})")
    cmd.add_argument("--json", action="store_true", help="also print the figures as JSON")
    cmd.set_defaults(handler=run_warm)


def run_warm(args: argparse.Namespace) -> int:
    sc = WarmScenario(preset=args.preset, history_words=args.history_words, streams=args.streams,
                      stream_tokens=args.stream_tokens)
    console = Console(stderr=True)
    work = temp_dir("slotwise-bench-warm-")
    console.print(f"[dim]testbed {sc.preset} model, fresh llama-server per phase (files in {work})[/dim]")
    figures = measure(work / "model", work, sc, server_args=args.server_args.split(),
                      log=lambda line: console.print(f"[dim]{line}[/dim]"))
    return show(warm_table(figures, sc), figures.as_dict(), as_json=args.json)


def warm_table(f: WarmFigures, sc: WarmScenario) -> Table:
    tokens = f"{f.history_tokens:,}" if f.history_tokens else "?"
    table = figures_table(f"warm-ups: a {tokens}-token history, {sc.streams} streams (testbed "
                          f"{sc.preset} model, one run)")
    for column in ("figure", "measured", "against", "aim"):
        table.add_column(column, justify="left" if column in ("figure", "aim") else "right")
    table.add_row("turn after the history's time alone: TTFT", seconds(f.warm_full_ttft_s),
                  f"cached {seconds(f.cached_ttft_s)} ({_ratio(f.warm_full_ttft_s, f.cached_ttft_s)})",
                  "≤ 1.5× cached")
    table.add_row("  the same against the cold turn", seconds(f.warm_full_ttft_s),
                  f"cold {seconds(f.cold_ttft_s)} ({_ratio(f.warm_full_ttft_s, f.cold_ttft_s)})", "")
    table.add_row("  its prompt found cached / credited to warm-ups",
                  percent(f.warm_full_cached_share), f"{f.warm_full_warmed_tokens or 0:,} tokens", "")
    table.add_row("turn after half that: TTFT", seconds(f.warm_half_ttft_s),
                  f"cold {seconds(f.cold_ttft_s)} ({_ratio(f.warm_half_ttft_s, f.cold_ttft_s)})",
                  "≤ 0.6× cold")
    for label, window in (("while a warm-up runs", f.during_warm),
                          ("while chunk feeds the cold turn", f.during_chunk)):
        table.add_row(f"streams' rate {label} (tok/s)", _n(window.rate),
                      f"alone {_n(f.streams_alone_rate)}", "≥ chunk's")
        table.add_row(f"  longest gap, over {seconds(window.seconds)}", seconds(window.longest_gap_s), "",
                      "≈ a piece")
    table.add_row("short turn during the warm-up: TTFT", seconds(f.short_during_warm_ttft_s),
                  f"before it {seconds(f.short_alone_ttft_s)}", "+ ≈ a piece")
    pieces = [r.get("pieces") or 0 for r in f.warm_records]
    table.caption = (f"warm-ups: {len(f.warm_records)}, outcomes "
                     f"{', '.join(str(r.get('outcome')) for r in f.warm_records)}; pieces "
                     f"{', '.join(map(str, pieces))}")
    return table



def _n(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"



def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}×"
