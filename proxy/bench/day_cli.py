"""`slotwise bench day`: the field report's day, compressed, on each chosen llama-server set-up and
path (proxy/bench/day_run.py), then the report's own tables and the day's figures side by side, one
column per path (day_tables.py). Only this module knows about terminals."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import orjson
from rich.console import Console

from proxy.bench.day import (
    DAY_SETUPS,
    DEFAULT_PATHS,
    DEFAULT_SETUPS,
    PATHS,
    DayPlan,
    plan_day,
    server_args,
)
from proxy.bench.day_tables import REPORT_KEYS, day_grid, report_grid
from proxy.bench.harness import temp_dir
from proxy.bench.output import print_table
from proxy.testbed.args import positive_int


def add_day(commands: Any) -> None:
    cmd = commands.add_parser(
        "day", help="a compressed field-report day: direct, direct -b 512, slotwise with everything on")
    cmd.add_argument("--setups", default=",".join(DEFAULT_SETUPS), metavar="NAMES",
                     help="llama-server set-ups, comma-separated: report (the field report's "
                          f"-np 4 -kvu), {', '.join(n for n in DAY_SETUPS if n != 'report')} "
                          f"(default {','.join(DEFAULT_SETUPS)})")
    cmd.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                     help=f"paths, comma-separated: {', '.join(PATHS)} (default "
                          f"{','.join(DEFAULT_PATHS)}; chunk: slotwise with prefill.mode = chunk "
                          "alone, to check `slotwise whatif --set prefill.mode=chunk` against)")
    cmd.add_argument("--scale", type=_scale, default=1.0,
                     help="token sizes, think times and turns of the day (default 1: histories of "
                          "4,000-6,000 tokens, about 15 minutes for the default set-ups and paths; "
                          "0.05 with --preset tiny --setups report is a quick check)")
    cmd.add_argument("--preset", choices=("tiny", "small"), default="small",
                     help="testbed model (default small)")
    cmd.add_argument("--repeat", type=positive_int, default=1,
                     help="play the day this many times; each cell then shows the median and the "
                          "range (default 1)")
    cmd.add_argument("--seed", type=int, default=19, help="the day's think times and texts")
    cmd.add_argument("--json", action="store_true", help="also print every run's figures as JSON")
    cmd.set_defaults(handler=run_day)


def _scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 10:
        raise argparse.ArgumentTypeError(f"expected a number above 0 and at most 10, got {value}")
    return value


def _names(text: str, valid: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise ValueError(f"--{what}: unknown {', '.join(unknown) or 'nothing given'} "
                         f"(valid: {', '.join(valid)})")
    return names


def run_day(args: argparse.Namespace) -> int:
    from proxy.bench.day_run import run_path
    from proxy.testbed.model import write_model

    console = Console(stderr=True)
    try:
        setups = _names(args.setups, list(DAY_SETUPS), "setups")
        paths = _names(args.paths, list(PATHS), "paths")
    except ValueError as exc:
        console.print(f"slotwise: {exc}", markup=False)
        return 2
    plan, began = plan_day(args.scale, args.seed), time.monotonic()
    work = temp_dir("slotwise-bench-day-")
    console.print(f"[dim]{describe(plan)}; testbed {args.preset} model; files in {work}[/dim]")
    model = write_model(work / "model", args.preset, seed=0)
    runs: list[dict[str, dict[str, Any]]] = []
    for n in range(1, args.repeat + 1):
        one: dict[str, dict[str, Any]] = {}
        for name in setups:
            one[name] = {}
            for path in paths:
                console.print(f"[dim]run {n} of {args.repeat}: set-up {name}, {PATHS[path]}[/dim]")
                one[name][PATHS[path]] = run_path(
                    model, plan, DAY_SETUPS[name], path, work / f"run{n}" / f"{name}-{path}",
                    say=lambda line: console.print(f"[dim]{line}[/dim]", highlight=False))
        runs.append(one)
    for name in setups:
        show_setup(name, plan, [run[name] for run in runs])
    elapsed = time.monotonic() - began
    console.print(f"[dim]{elapsed / 60:.1f} minutes in all; logs and records in {work}[/dim]")
    if args.json:
        print(orjson.dumps({"plan": plan.as_dict(), "preset": args.preset, "runs": runs,
                            "elapsed_s": elapsed}, option=orjson.OPT_INDENT_2).decode())
    return 0


def show_setup(name: str, plan: DayPlan, runs: list[dict[str, Any]]) -> None:
    """The set-up's tables: the report's three, then the day's own figures."""
    flags = " ".join(server_args(DAY_SETUPS[name], "direct", plan.ctx_per_slot))
    what = "one run" if len(runs) == 1 else f"median (range) of {len(runs)} runs"
    where = f"{name} ({flags}), {what}"
    for key in REPORT_KEYS:
        print_table(report_grid([{p: r["tables"][key] for p, r in run.items()} for run in runs],
                                key, where))
    print_table(day_grid([{p: r["day"] for p, r in run.items()} for run in runs], where))


def describe(plan: DayPlan) -> str:
    """The day in one line: who comes back with what, the thresholds of the tables."""
    back = ", ".join(f"{u.name} {u.yesterday_tokens:,}" for u in plan.users if u.yesterday_tokens)
    cards = ", ".join(f"{u.name} {u.card_tokens:,}" for u in plan.users if u.card_tokens)
    return (f"scale {plan.scale:g}: histories saved yesterday ({back} tokens), cards ({cards}); "
            f"long prefill >= {plan.long_tokens:,} tokens, short turn < {plan.short_tokens:,}")
