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
    """One side of a comparison: `v1 / v2 / v3 (n)`, the sample count always shown."""
    if row is None:
        return "-"
    values = " / ".join(row_cells(table, row))
    return f"{values} ({row.n})" if values else str(row.n)


def compact_header(table: Table, name: str) -> str:
    return f"{name}: {' / '.join(table.columns)} ({table.n_label})" if table.columns else name


def paired_tables(a: Report, b: Report) -> list[tuple[Table, Table | None]]:
    by_key = {t.key: t for t in b.tables}
    return [(t, by_key.get(t.key)) for t in a.tables]


def paired_rows(a: Table, b: Table | None) -> list[tuple[str, Row | None, Row | None]]:
    rows_b = {r.label: r for r in (b.rows if b else ())}
    result: list[tuple[str, Row | None, Row | None]] = [
        (r.label, r, rows_b.pop(r.label, None)) for r in a.rows
    ]
    result += [(label, None, r) for label, r in rows_b.items()]
    return result


def header(table: Table) -> Sequence[str]:
    return ("", table.n_label, *table.columns)
