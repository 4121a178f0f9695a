"""`slotwise bench keep [--json]`: runs `proxy.bench.keep_run` (keep_kv, docs/keep-kv.md) and prints
its figures beside their baselines and issue #15's aims. Only this module knows about terminals."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from proxy.bench.harness import temp_dir
from proxy.bench.keep_run import KeepFigures, KeepScenario, Turn, measure
from proxy.bench.output import figures_table, percent, print_table, seconds
from proxy.testbed.args import positive_int
from proxy.testbed.model import write_model

FOUND = 0.95
"""A returning turn 'finds its prefix' when this share of its prompt was cached (the aim)."""


def add_keep(commands: Any) -> None:
    cmd = commands.add_parser(
        "keep", help="conversations kept on disk: a returning turn restored against recomputed")
    d = KeepScenario()
    cmd.add_argument("--preset", choices=("tiny", "small"), default="small",
                     help="testbed model (default small)")
    cmd.add_argument("--history-words", type=positive_int, default=d.history_words,
                     help=f"the returning user's history in words (default {d.history_words}, "
                          "about 14,000 tokens)")
    cmd.add_argument("--decoders", type=int, default=d.decoders,
                     help=f"streams decoding during the returning turn (default {d.decoders})")
    cmd.add_argument("--conversations", type=positive_int, default=d.conversations,
                     help=f"conversations of day one (default {d.conversations})")
    cmd.add_argument("--conv-words", type=positive_int, default=d.conv_words,
                     help=f"each one's history in words (default {d.conv_words})")
    cmd.add_argument("--slots", type=positive_int, default=d.slots,
                     help=f"llama-server's -np (default {d.slots})")
    cmd.add_argument("--small-budget", type=positive_int, default=d.small_budget,
                     help=f"conversations the smaller disk budget holds (default {d.small_budget})")
    cmd.add_argument("--ctx", type=positive_int, default=d.ctx,
                     help=f"llama-server's -c, one KV shared by the slots (default {d.ctx})")
    cmd.add_argument("--json", action="store_true", help="also print the figures as JSON")
    cmd.set_defaults(handler=run_keep)


def run_keep(args: argparse.Namespace) -> int:
    sc = KeepScenario(history_words=args.history_words, decoders=args.decoders,
                      conversations=args.conversations, conv_words=args.conv_words,
                      slots=args.slots, small_budget=args.small_budget, ctx=args.ctx)
    if not 0 <= sc.decoders < sc.slots or sc.small_budget >= sc.conversations:
        print("slotwise: --decoders must be below --slots (the returning turn needs a slot), and "
              "--small-budget below --conversations", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    work = temp_dir("slotwise-bench-keep-")
    console.print(f"[dim]testbed {args.preset} model; llama-server -np {sc.slots} -kvu -c {sc.ctx} "
                  f"--cache-ram 0 --slot-save-path (files in {work})[/dim]")
    model = write_model(work / "model", args.preset, seed=0).model
    figures = asyncio.run(measure(model, sc, work))
    print_table(returning_table(figures, sc, args.preset))
    print_table(budget_table(figures, sc))
    if args.json:
        import orjson

        print(orjson.dumps(figures.as_dict(), option=orjson.OPT_INDENT_2).decode())
    return 0


def returning_table(f: KeepFigures, sc: KeepScenario, preset: str) -> Table:
    restored, cold = f.returning_restored, f.returning_recomputed
    tokens = f"{restored.prompt_tokens:,}" if restored and restored.prompt_tokens else "?"
    table = figures_table(f"a returning user's {tokens}-token turn, saved the day before, llama-server "
                          f"restarted, {sc.decoders} others decoding (testbed {preset} model)")
    for column in ("figure", "restored", "recomputed", "aim"):
        table.add_column(column, justify="left" if column in ("figure", "aim") else "right")
    table.add_row("time to first token", seconds(_of(restored, "ttft_s")), seconds(_of(cold, "ttft_s")),
                  "≤ 2 s restored (~35 s recomputed)")
    table.add_row("prompt tokens computed for it", _n(_of(restored, "computed")),
                  _n(_of(cold, "computed")), "the new message only")
    table.add_row("prompt tokens restored from a file", _n(_of(restored, "restored_tokens")),
                  "", "")
    table.add_row("the others' longest gap meanwhile", seconds(_of(restored, "decoder_gap_s")),
                  seconds(_of(cold, "decoder_gap_s")), "≤ one piece")
    table.caption = f"the day before, that history took {seconds(f.day_one_s)} to its first token (cold)"
    return table


def budget_table(f: KeepFigures, sc: KeepScenario) -> Table:
    table = figures_table(f"{sc.conversations} conversations over {sc.slots} slots: day two, after "
                          "llama-server restarted")
    for column in ("disk budget for", "turns ≥ 95 % cached", "of the last N used", "of the others",
                   "median cached share", "aim"):
        table.add_column(column, justify="left" if column in ("disk budget for", "aim") else "right")
    for label, turns in f.budgets.items():
        keep = len(turns) if label == "all" else int(label)
        recent, older = turns[len(turns) - keep:], turns[:len(turns) - keep]
        table.add_row(f"{label} conversations", _found(turns), f"{_found(recent)} (N={keep})",
                      _found(older), percent(_median([t.cached_share for t in turns])),
                      "every turn" if label == "all" else f"the {keep} most recently used")
    return table


def _of(turn: Turn | None, key: str) -> Any:
    return None if turn is None else getattr(turn, key)


def _found(turns: list[Turn]) -> str:
    hits = sum(1 for t in turns if (t.cached_share or 0) >= FOUND)
    return f"{hits} of {len(turns)}"


def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None



def _n(value: int | None) -> str:
    return "–" if value is None else f"{value:,}"

