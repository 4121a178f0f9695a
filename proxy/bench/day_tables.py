"""The tables `slotwise bench day` prints (pure aggregation; rich tables, printed by day_cli.py):
the field report's own tables, built by `slotwise report`'s code (proxy/report) from each path's
timing records, side by side with one column per path; and the day's own figures. Over several
runs, each cell is the median with the range under it, e.g. `210 ms` over `(180-250)`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from rich.table import Table

from proxy.bench.output import figures_table
from proxy.report.cells import TIME_UNITS, fmt, time_number, time_unit
from proxy.report.model import quantile
from proxy.report.records import LoadedTimingLog, RecordLine
from proxy.report.render import table_dict
from proxy.report.reports import timing_report
from proxy.report.tables import Thresholds

REPORT_KEYS = ("ttft_short", "decode_rate", "waits")
"""The report's tables the day compares: short turns' time to first token by what else ran, the
streams' rate during long prefills, waits of 1 s or more before the prefill and what ran meanwhile."""

Runs = Sequence[Mapping[str, Mapping[str, Any]]]
"""One mapping per run: path label → that path's figures (a table as `table_dict`, or the day's)."""
Pick = Callable[[Mapping[str, Any]], float | int | None]
"""Takes one figure out of a path's day figures (KeyError, IndexError: it has none)."""


def report_tables(records: Sequence[RecordLine], log: LoadedTimingLog, th: Thresholds
                  ) -> dict[str, dict[str, Any]]:
    """The report's tables of one path, by key, as `slotwise report --format json` has them."""
    report = timing_report(log.path, records, log, th)
    return {t.key: table_dict(t) for t in report.tables if t.key in REPORT_KEYS}


def cell(values: Sequence[float | None], unit: str) -> str:
    """One run's value, or over several the median with the range on a line of its own (three
    paths side by side then fit 80 columns): `210 ms` over `(180-250)`. Numbers read as in the
    report (proxy/report/cells.py); a time's range is in its median's unit."""
    known = [v for v in values if v is not None]
    if not known:
        return "–"
    # A count's median is one of the counts seen (median_low), never half a request.
    middle = (statistics.median_low if unit == "" else statistics.median)(known)
    if len(values) == 1:
        return fmt(middle, unit)
    if unit in TIME_UNITS:
        shown = time_unit(_seconds(middle, unit))
        low, high = (time_number(_seconds(v, unit), shown) for v in (min(known), max(known)))
        return f"{time_number(_seconds(middle, unit), shown)} {shown}\n({low}-{high})"
    low, high = (_bare(v, unit) for v in (min(known), max(known)))
    return f"{fmt(middle, unit)}\n({low}-{high})"


def _seconds(value: float, unit: str) -> float:
    return value if unit == "s" else value / 1000


def _bare(value: float, unit: str) -> str:
    """A figure without its unit, for a range."""
    return fmt(value, unit).removesuffix(f" {unit}").removesuffix("%").removesuffix("×")


def _grid(title: str, paths: Sequence[str]) -> Table:
    table = figures_table(title)
    table.add_column("")
    for path in paths:
        table.add_column(path, justify="right")
    return table


def _paths(runs: Runs) -> list[str]:
    return list(runs[0]) if runs else []


def report_grid(runs: Runs, key: str, where: str = "") -> Table:
    """One of the report's tables (`key`), a column per path: a line per row of the report (with
    its sample count), then a line per figure. `where` heads the title (the set-up, the runs)."""
    paths = _paths(runs)
    tables = [run[p] for run in runs for p in paths if p in run]
    first = tables[0]
    grid = _grid(f"{where}: {first['title']}" if where else first["title"], paths)
    for label in _labels(tables):
        rows = {p: [_row(run.get(p), label) for run in runs] for p in paths}
        grid.add_row(f"{label} ({first['n_label']})",
                     *(cell([r["n"] if r else 0 for r in rows[p]], "") for p in paths))
        for i, (column, unit) in enumerate(zip(first["columns"], first["units"], strict=True)):
            grid.add_row(f"  {column}", *(cell([r["values"][i] if r else None for r in rows[p]],
                                               unit) for p in paths))
    grid.caption = _notes({p: t["note"] for run in runs for p, t in run.items() if t.get("note")})
    return grid


def _notes(notes: Mapping[str, str]) -> str | None:
    """The tables' notes: once if every path has the same, else each with its path."""
    if len(set(notes.values())) == 1 and len(notes) > 1:
        return next(iter(notes.values()))
    return "\n".join(f"{p}: {note}" for p, note in notes.items()) or None


def _labels(tables: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every row label of the tables, in order of first appearance (a row with no samples on one
    path may be missing there)."""
    seen: list[str] = []
    for table in tables:
        seen += [row["label"] for row in table["rows"] if row["label"] not in seen]
    return seen


def _row(table: Mapping[str, Any] | None, label: str) -> Mapping[str, Any] | None:
    return next((r for r in (table or {}).get("rows", ()) if r["label"] == label), None)


def day_grid(runs: Runs, where: str = "") -> Table:
    """The day's own figures, a column per path: the returning users' and post-summary turns'
    time to first token (with what slotwise restored or warmed for them, and how long a returning
    user found every slot taken), every request's time to first token by its purpose (the chat
    turns apart from the background jobs), how many requests found every slot taken and for how long (on
    `-np 4` with six clients, the largest part of the short turns' time to first token), each
    cold request against its time alone, everyone's longest gap (under the table, the prompts computed
    during it)."""
    paths = _paths(runs)
    title = "returning users, turns after a summary, everyone's longest gap"
    grid = _grid(f"{where}: {title}" if where else title, paths)
    first = runs[0][paths[0]]
    for kind, label, extra, word in (
            ("returning", "returns", "restored_tokens", "restored from a file"),
            ("after_summary", "after the summary", "warmed_tokens", "warmed ahead")):
        for who in dict.fromkeys(turn["who"] for turn in first[kind]):
            grid.add_row(f"{who} {label}: time to first token",
                         *_cells(runs, paths, _turn(kind, who, "ttft_s"), "s"))
            grid.add_row("  its prompt (tokens)",
                         *_cells(runs, paths, _turn(kind, who, "prompt_tokens"), ""))
            grid.add_row(f"  {word} (tokens)", *_cells(runs, paths, _turn(kind, who, extra), ""))
            if kind == "returning":
                grid.add_row("  every slot taken for", *_cells(runs, paths,
                                                             _turn(kind, who, "slot_wait_s"), "s"))
    for purpose in first.get("first_token_s") or {}:
        grid.add_row(f"{purpose} requests: time to first token (n)",
                     *_cells(runs, paths, _first_tokens(purpose, len), ""))
        for name, q in (("median", 0.5), ("p90", 0.9)):
            grid.add_row(f"  {name}", *_cells(runs, paths,
                                              _first_tokens(purpose, partial(quantile, q=q)), "s"))
    grid.add_row("requests that found every slot taken",
                 *_cells(runs, paths, _slot_waits(len), ""))
    grid.add_row("  waited for one: median", *_cells(runs, paths, _slot_waits(_median), "s"))
    grid.add_row("  the longest", *_cells(runs, paths, _slot_waits(_longest), "s"))
    grid.add_row("cold requests (a long prefill)", *_cells(runs, paths, _cold_count, ""))
    grid.add_row("  first token ÷ own time alone: median",
                 *_cells(runs, paths, _times_alone(statistics.median), "×"))
    grid.add_row("  the worst", *_cells(runs, paths, _times_alone(max), "×"))
    grid.add_row("longest gap between tokens", *("" for _ in paths))
    for who in first["longest_gap_s"]:
        grid.add_row(f"  {who}", *_cells(runs, paths, _gap(who), "s"))
    grid.add_row("requests failed", *_cells(runs, paths, _failed, ""))
    grid.add_row("requests cut by the day's end", *_cells(runs, paths, _cut, ""))
    if any(f.get("not_played") for run in runs for f in run.values()):
        grid.add_row("requests not played (the day was cut)",
                     *_cells(runs, paths, _not_played, ""))
    grid.add_row("the day's length", *_cells(runs, paths, _length, "s"))
    grid.add_row("all streams together, over the day", *_cells(runs, paths, _events_rate, "ev/s"))
    grid.caption = "prompts computed during everyone's longest gap:\n" + "\n".join(
        f"{path}: {_during(runs, path)}" for path in paths)
    return grid


def _turn(kind: str, who: str, key: str) -> Pick:
    """`who`'s turn of this kind (each user returns, or resumes after a summary, once a day):
    by name, since the order the turns came in differs between runs and paths."""
    def pick(figures: Mapping[str, Any]) -> float | int | None:
        turn = next((t for t in figures[kind] if t["who"] == who), None)
        value = None if turn is None else turn.get(key)
        return value if isinstance(value, int | float) else None
    return pick


def _first_tokens(purpose: str, of: Callable[[list[float]], float | int | None]) -> Pick:
    """Of the times to first token of the requests of one purpose (`day_records.first_tokens`)."""
    return _of_values(lambda figures: (figures.get("first_token_s") or {}).get(purpose), of)


def _cold_count(figures: Mapping[str, Any]) -> int | None:
    cold = figures.get("cold")
    return None if cold is None else len(cold)


def _times_alone(of: Callable[[list[float]], float]) -> Pick:
    """The cold requests' first token in multiples of their own time alone (`day_records.cold_turn`),
    the median or the worst."""
    def pick(figures: Mapping[str, Any]) -> float | None:
        ratios = [t["times_alone"] for t in figures.get("cold") or ()
                  if isinstance(t.get("times_alone"), int | float)]
        return of(ratios) if ratios else None
    return pick


def _slot_waits(of: Callable[[list[float]], float | int | None]) -> Pick:
    """Of the waits for a free slot (`day_records.slot_waits`): their number, median or longest.
    None: the server's slots were not known."""
    return _of_values(lambda figures: figures.get("slot_waits"), of)


def _of_values(values: Callable[[Mapping[str, Any]], list[float] | None],
               of: Callable[[list[float]], float | int | None]) -> Pick:
    """`of` a list of the figures (None where they have none)."""
    def pick(figures: Mapping[str, Any]) -> float | int | None:
        found = values(figures)
        return None if found is None else of(found)
    return pick


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _longest(values: list[float]) -> float | None:
    return max(values, default=None)


def _gap(who: str) -> Pick:
    return lambda figures: figures["longest_gap_s"].get(who)


def _during(runs: Runs, path: str) -> str:
    """The prefills that overlapped everyone's longest gap, each run's (`; ` between runs)."""
    nothing = _SLOTWISE_OWN if path == "slotwise" else "no request's"
    return "; ".join(", ".join(run[path].get("longest_gap_during") or ()) or nothing
                     for run in runs if path in run)


_SLOTWISE_OWN = "no request's (slotwise's own work: a piece, a restore or a warm-up)"


def _failed(figures: Mapping[str, Any]) -> int:
    return len(figures["failed"])


def _cut(figures: Mapping[str, Any]) -> int:
    return len(figures.get("cut") or ())


def _not_played(figures: Mapping[str, Any]) -> int:
    return int(figures.get("not_played") or 0)


def _events_rate(figures: Mapping[str, Any]) -> float | None:
    value = figures.get("events_per_s")
    return value if isinstance(value, int | float) else None


def _length(figures: Mapping[str, Any]) -> float | None:
    value = figures["day_s"]
    return value if isinstance(value, int | float) else None


def _cells(runs: Runs, paths: Sequence[str], pick: Pick, unit: str) -> list[str]:
    out = []
    for path in paths:
        values = []
        for run in runs:
            try:
                values.append(pick(run[path]))
            except (KeyError, IndexError):
                values.append(None)
        out.append(cell(values, unit))
    return out
