"""Formatting of numbers and the pairing of two reports' tables, shared by every renderer."""

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
    if unit in ("tok/s", "ev/s"):
        digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
        return f"{value:,.{digits}f} {unit}"
    if unit in ("s", "ms"):
        digits = 1 if abs(value) < 100 else 0
        return f"{value:,.{digits}f} {unit}"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def row_cells(table: Table, row: Row) -> list[str]:
    return [fmt(v, u) for v, u in zip(row.values, table.units, strict=False)]


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
