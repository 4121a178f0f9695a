"""Formatting of numbers and the pairing of two reports' tables, shared by every renderer.

The one owner of how a time reads: under a second in ms (`340 ms`), from a second on in s
(`2.4 s`), whether the figure was kept in seconds or in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.report.model import Report, Row, Table


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{value:.0f}%"
    if unit == "tok":
        return f"{value:,.0f}"
    if unit == "×":
        return f"{value:,.1f}×"
    if unit in ("tok/s", "ev/s"):
        digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
        return f"{value:,.{digits}f} {unit}"
    if unit in TIME_UNITS:
        seconds = value if unit == "s" else value / 1000
        shown = time_unit(seconds)
        return f"{time_number(seconds, shown)} {shown}"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


TIME_UNITS = ("s", "ms")


def time_unit(seconds: float) -> str:
    """The unit a time is shown in: ms under a second, else s."""
    return "ms" if round(abs(seconds) * 1000) < 1000 else "s"  # 0.9996 s reads 1.0 s, not 1,000 ms


def time_number(seconds: float, shown: str) -> str:
    """A time as a number in the unit `shown` (see `time_unit`), without the unit: 0.1 ms under
    10 ms, 0.1 s under 100 s, whole numbers otherwise."""
    value = seconds * 1000 if shown == "ms" else seconds
    digits = 1 if abs(value) < (10 if shown == "ms" else 100) else 0
    return f"{value:,.{digits}f}"


def row_cells(table: Table, row: Row) -> list[str]:
    units = table.units if row.unit is None else (row.unit,) * len(row.values)
    return [fmt(v, u) for v, u in zip(row.values, units, strict=False)]


def compact(table: Table, row: Row | None) -> str:
    """One side of a comparison: `v1 / v2 / v3 (n)`, the sample count always shown; a row the
    other side has and this one lacks had no samples here."""
    if row is None:
        values = " / ".join("-" for _ in table.columns)
        return f"{values} (0)" if values else "0"
    values = " / ".join(row_cells(table, row))
    return f"{values} ({row.n})" if values else str(row.n)


def compact_legend(table: Table) -> str:
    """What each cell of a comparison holds, e.g. `median / p95 / max (n)`: the header of the
    label column, so that the two reports' columns need only their names."""
    return f"{' / '.join(table.columns)} ({table.n_label})" if table.columns else table.n_label


def paired_tables(a: Report, b: Report) -> list[tuple[Table, Table | None]]:
    by_key = {t.key: t for t in b.tables}
    return [(t, by_key.get(t.key)) for t in a.tables]


def paired_rows(a: Table, b: Table | None) -> list[tuple[str, Row | None, Row | None]]:
    """The rows of both tables by label, in a's order; a row only b has comes right after the
    row that precedes it in b (tables list their rows in a fixed order)."""
    rows_a = {r.label: r for r in a.rows}
    rows_b = {r.label: r for r in (b.rows if b else ())}
    labels = list(rows_a)
    previous: str | None = None
    for label in rows_b:
        if label not in rows_a:
            at = labels.index(previous) + 1 if previous is not None else 0
            labels.insert(at, label)
        previous = label
    return [(label, rows_a.get(label), rows_b.get(label)) for label in labels]


def header(table: Table) -> Sequence[str]:
    return ("", table.n_label, *table.columns)
