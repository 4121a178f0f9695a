"""`slotwise bench contention [--json]`: runs `proxy.bench.contention` and prints one table (one
column per path), the baselines it was measured against, and the estimate against the server's
own prompt counts. Only this module knows about terminals.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from proxy.bench.contention import (
    PATHS,
    SERVER_ARGS,
    Baseline,
    Run,
    Scenario,
    decode_rate,
    max_gap,
    measure,
    pct,
)
from proxy.bench.harness import temp_dir
from proxy.bench.output import figures_table, print_table
from proxy.bench.setups import FIELD, FIELD_ARGS, SETUPS, cpu_competitor
from proxy.bench.setups_table import setups_table
from proxy.testbed.args import positive_int

PREFILL = {"cold_tokens": 1000}
"""The slotwise runs use the shipped defaults except a cold threshold below the cold prompt."""


def add_contention(commands: Any) -> None:
    cmd = commands.add_parser(
        "contention", help="a cold prompt among generating streams: direct, -b 512, defer, chunk")
    cmd.add_argument("--streams", type=positive_int, default=Scenario.streams,
                     help=f"requests generating when the cold prompt comes (default {Scenario.streams})")
    cmd.add_argument("--stream-tokens", type=int, default=Scenario.stream_tokens,
                     help=f"tokens per generating stream (default {Scenario.stream_tokens})")
    cmd.add_argument("--cold-words", type=int, default=Scenario.cold_words,
                     help=f"cold history size in words (default {Scenario.cold_words}, "
                          "about 3,400 tokens)")
    cmd.add_argument("--shorts", type=int, default=Scenario.shorts,
                     help=f"short turns arriving during the run (default {Scenario.shorts})")
    cmd.add_argument("--arrivals", choices=("random", "periodic"), default=Scenario.arrivals,
                     help="short turns arrive each at a random moment of its own "
                          f"{Scenario.short_every_s} s window (seeded: the same times on every "
                          f"path) or exactly every {Scenario.short_every_s} s "
                          f"(default {Scenario.arrivals})")
    cmd.add_argument("--paths", default=",".join(PATHS),
                     help=f"paths to measure, comma-separated (default {','.join(PATHS)})")
    cmd.add_argument("--prefill", action="append", default=[], metavar="KEY=NUMBER",
                     help="override a [prefill] setting of the slotwise paths (repeatable)")
    cmd.add_argument("--server-args", default=" ".join(SERVER_ARGS),
                     help=f"llama-server flags of every path (default {' '.join(SERVER_ARGS)!r})")
    cmd.add_argument("--repeat", type=positive_int, default=1,
                     help="measure everything this many times (fresh servers and baselines each "
                          "time) and end with each figure's range over the runs (default 1)")
    cmd.add_argument("--setups", default="", metavar="NAMES",
                     help="run every path on each of these llama-server set-ups, comma-separated, "
                          f"each with its own baselines ({', '.join(SETUPS)}, or all); "
                          "then a summary table of all of them")
    cmd.add_argument("--competitor", action="store_true",
                     help="a CPU competitor (one spinning core) runs beside every phase")
    cmd.add_argument("--scenario", choices=("default", "field"), default="default",
                     help="field: the field report's scale (three users chatting, short turns, a "
                          "~16,000-token history) on its server "
                          f"({' '.join(FIELD_ARGS)}) unless --server-args or --setups say otherwise")
    cmd.add_argument("--json", action="store_true", help="also print the figures as JSON")
    cmd.set_defaults(handler=run_contention)


def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = dict(PREFILL)
    for item in items:
        key, _, value = item.partition("=")
        out[key.strip()] = float(value) if "." in value else int(value)
    return out


def figures(run: Run, base: Baseline) -> dict[str, Any]:
    window = run.window()
    lo, hi = window if window else (None, None)
    rate = decode_rate(run.streams, lo, hi) if window else None
    gaps = [g for g in (max_gap(s) for s in run.streams) if g is not None]
    ttft = [s.ttft for s in run.shorts if s.ttft is not None]
    p50, p90 = pct(ttft, 50), pct(ttft, 90)
    b50, b90 = pct(base.short_ttft, 50), pct(base.short_ttft, 90)
    cold = run.cold.ttft if run.cold else None
    turns = [s.ttft for s in run.streams if window and window[0] <= s.sent <= window[1]
             and s.ttft is not None]
    tokens = sum(len(s.tokens) for s in [*run.streams, *run.shorts])
    tokens += len(run.cold.tokens) if run.cold else 0
    return {
        "stream_rate": rate, "stream_rate_alone": base.stream_rate,
        "stream_rate_pct": 100.0 * rate / base.stream_rate if rate is not None else None,
        "stream_max_gap_s": max(gaps) if gaps else None,
        "short_ttft_p50_s": p50, "short_ttft_p90_s": p90,
        "short_ttft_p50_x": p50 / b50 if p50 and b50 else None,
        "short_ttft_p90_x": p90 / b90 if p90 and b90 else None,
        "short_ttft_uncontended_p50_s": b50, "short_ttft_uncontended_p90_s": b90,
        "shorts": len(ttft),
        "shorts_over_1_5x": sum(1 for t in ttft if t > 1.5 * b90) if b90 else None,
        "turn_ttft_p90_s": pct(turns, 90), "turns": len(turns),
        "cold_ttft_s": cold, "cold_ttft_alone_s": base.cold_ttft,
        "cold_ttft_alone_runs_s": list(base.cold_alone),
        "cold_ttft_x": cold / base.cold_ttft if cold else None,
        "tokens_per_s": tokens / (run.ended - run.started),
        "estimates": estimates(run.records),
    }


def estimates(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per slotwise record: the estimate beside the server's counts. For a chunked request the
    server's prompt_n is only the rest after the pieces, so its total prompt is compared."""
    out = []
    for rec in records:
        timings = rec.get("timings") or {}
        prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
        if rec.get("est_new_tokens") is None or prompt_n is None:
            continue
        out.append({"purpose": rec.get("prefill_plan"), "est_prompt": rec.get("est_prompt_tokens"),
                    "est_new": rec.get("est_new_tokens"), "prompt_n": prompt_n,
                    "cache_n": cache_n, "pieces": rec.get("pieces"),
                    "held_ms": rec.get("held_ms"), "note": rec.get("policy_note")})
    return out


ROWS: tuple[tuple[str, str, str], ...] = (
    ("streams' rate during the cold prompt (tok/s)", "stream_rate", "{:.1f}"),
    ("  as % of their rate alone", "stream_rate_pct", "{:.1f} %"),
    ("streams' longest gap (s)", "stream_max_gap_s", "{:.2f}"),
    ("short turns' TTFT p50 (s)", "short_ttft_p50_s", "{:.3f}"),
    ("short turns' TTFT p90 (s)", "short_ttft_p90_s", "{:.3f}"),
    ("  p90 as × uncontended", "short_ttft_p90_x", "{:.2f} ×"),
    ("  short turns over 1.5 × uncontended p90", "shorts_over_1_5x", "{} of {shorts}"),
    ("streams' new turns meanwhile: TTFT p90 (s)", "turn_ttft_p90_s", "{:.3f} ({turns})"),
    ("cold request's TTFT (s)", "cold_ttft_s", "{:.2f}"),
    ("  as × alone", "cold_ttft_x", "{:.2f} ×"),
    ("tokens generated per second, overall", "tokens_per_s", "{:.1f}"),
)


def _fmt(fmt: str, value: Any) -> str:
    return "–" if value is None else fmt.format(value)


def _cell(fmt: str, key: str, fig: dict[str, Any]) -> str:
    """`fmt` formats fig[key]; it may name other figures too ("{} of {shorts}")."""
    return "–" if fig.get(key) is None else fmt.format(fig[key], **fig)


def render(results: dict[str, dict[str, Any]], bases: dict[str, Baseline], streams: int = 3
           ) -> Table:
    beside = "one generating stream" if streams == 1 else f"{streams} generating streams"
    table = figures_table(f"a cold prompt beside {beside} (testbed small model)")
    table.add_column("figure")
    for path in results:
        table.add_column(path, justify="right")
    for label, key, fmt in ROWS:
        table.add_row(label, *(_cell(fmt, key, fig) for fig in results.values()))
    for name, base in bases.items():
        table.caption = (table.caption or "") + (
            f"baseline {name}: streams alone {base.stream_rate:.1f} tok/s each, short TTFT "
            f"p50/p90 {_fmt('{:.3f}', pct(base.short_ttft, 50))}/"
            f"{_fmt('{:.3f}', pct(base.short_ttft, 90))} s, cold alone {base.cold_ttft:.2f} s"
            f"{_alone_runs(base)}\n")
    return table


def _alone_runs(base: Baseline) -> str:
    """The timings the cold prompt's baseline is the median of, when there are several."""
    if len(base.cold_alone) < 2:
        return ""
    return f" (median of {', '.join(f'{t:.2f}' for t in base.cold_alone)})"


def estimate_table(results: dict[str, dict[str, Any]]) -> Table:
    """The cold request of each slotwise path row by row; the other requests summed up."""
    table = figures_table("estimate before forwarding vs the server's timings (slotwise records)")
    for column in ("path", "reqs", "plan", "est prompt", "est new", "server new", "server cached",
                   "pieces", "held ms", "error of est new", "note"):
        table.add_column(column, justify="left" if column in ("path", "plan", "note") else "right")
    for path, fig in results.items():
        rows = fig["estimates"]
        for e in (e for e in rows if e["est_new"] >= PREFILL["cold_tokens"]):
            table.add_row(path, "1", str(e["purpose"]), *(_fmt("{:,}", e[k]) for k in (
                "est_prompt", "est_new", "prompt_n", "cache_n", "pieces")),
                _fmt("{:,.0f}", e["held_ms"]), _fmt("{:+.1f} %", est_error(e)),
                str(e["note"] or ""))
        short = [e for e in rows if e["est_new"] < PREFILL["cold_tokens"]]
        if short:
            worst = max(short, key=lambda e: abs(e["est_new"] - e["prompt_n"]))
            table.add_row(path, str(len(short)), "others (worst)",
                          *(_fmt("{:,}", worst[k]) for k in ("est_prompt", "est_new", "prompt_n",
                                                              "cache_n", "pieces")),
                          "", _fmt("{:+.1f} %", est_error(worst)),
                          "")
    return table


def est_error(e: dict[str, Any]) -> float | None:
    """Relative error of the new-token estimate; for a chunked request, of the prompt total."""
    if e["pieces"]:
        actual, est = e["prompt_n"] + (e["cache_n"] or 0), e["est_prompt"]
    else:
        actual, est = e["prompt_n"], e["est_new"]
    return 100.0 * (est - actual) / actual if actual else None


def scenario(args: argparse.Namespace) -> Scenario:
    if args.scenario == "field":
        return FIELD
    return Scenario(streams=args.streams, stream_tokens=args.stream_tokens, cold_words=args.cold_words,
                    shorts=args.shorts, arrivals=args.arrivals)


def setups(args: argparse.Namespace) -> dict[str, list[str]]:
    """The set-ups to run, by name: --setups, else --server-args (the field scenario's own server
    unless they were given)."""
    if not args.setups:
        default = " ".join(FIELD_ARGS) if args.scenario == "field" else " ".join(SERVER_ARGS)
        given = args.server_args if args.server_args != " ".join(SERVER_ARGS) else default
        return {given: given.split()}
    names = list(SETUPS) if args.setups == "all" else [n.strip() for n in args.setups.split(",")]
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise ValueError(f"--setups: unknown set-up {', '.join(unknown)} (valid: "
                         f"{', '.join(SETUPS)}, all)")
    return {name: list(SETUPS[name]) for name in names}


def run_contention(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    sc = scenario(args)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    beside = cpu_competitor if args.competitor else contextlib.nullcontext
    try:
        chosen = setups(args)
    except ValueError as exc:
        console.print(f"slotwise: {exc}", markup=False)
        return 2
    every: list[dict[str, Any]] = []
    for n in range(args.repeat):
        if args.repeat > 1:
            console.print(f"[dim]run {n + 1} of {args.repeat}[/dim]")
        one: dict[str, Any] = {}
        for name, server_args in chosen.items():
            work = temp_dir("slotwise-contention-")
            console.print(f"[dim]set-up {name}[/dim]")
            runs, bases = measure(work / "model", work, sc, _overrides(args.prefill), paths=paths,
                                  server_args=server_args, beside=beside,
                                  log=lambda line: console.print(f"[dim]{line}[/dim]"))
            results = {path: figures(run, bases["b512" if "512" in path else "default"])
                       for path, run in runs.items()}
            print_table(render(results, bases, sc.streams))
            print_table(estimate_table(results))
            console.print(f"[dim]logs and timing records in {work}[/dim]")
            one[name] = {"results": results,
                         "baselines": {k: v.__dict__ for k, v in bases.items()}}
        every.append(one)
    if len(every[0]) > 1 or args.repeat > 1:
        print_table(setups_table(every, _overrides(args.prefill)))
    if args.repeat > 1 and len(every[0]) == 1:
        (name,) = every[0]
        print_table(ranges_table([run[name]["results"] for run in every]))
    if args.json:
        print(orjson.dumps(every[0] if args.repeat == 1 else {"runs": every},
                           option=orjson.OPT_INDENT_2).decode())
    return 0


def ranges_table(runs: list[dict[str, dict[str, Any]]]) -> Table:
    """Each figure's lowest and highest value over the runs, per path."""
    table = figures_table(f"range over {len(runs)} runs (each against its own baselines)")
    table.add_column("figure")
    for path in runs[0]:
        table.add_column(path, justify="right")
    for label, key, fmt in ROWS:
        cells = []
        for path in runs[0]:
            values = [r[path][key] for r in runs if r.get(path, {}).get(key) is not None]
            cells.append(_range(fmt, values))
        table.add_row(label, *cells)
    return table


def _range(fmt: str, values: list[Any]) -> str:
    """The lowest and the highest value, the unit once: "42.8–54.6 %" ("{} of {shorts}": "9–12")."""
    if not values:
        return "–"
    number, _, unit = fmt.partition("}")
    unit = "" if "{" in unit else unit
    return f"{(number + '}').format(min(values))}–{(number + '}').format(max(values))}{unit}"
