"""Renders reports for the terminal (rich), as Markdown, or as JSON; one or two side by side.

In the terminal a table fits the console's width by wrapping its labels, never by cutting a
figure (proxy/report/fit.py)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import orjson
from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table as RichTable
from rich.text import Text

from proxy.report.cells import compact, compact_legend, header, paired_rows, paired_tables, row_cells
from proxy.report.fit import fit_columns, print_table
from proxy.report.model import Report, Table


def to_text(reports: Sequence[Report], names: Sequence[str], width: int = 120, color: bool = False) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=color, no_color=not color)
    console.print(f"[bold]{' vs '.join(r.title for r in reports)}[/bold]")
    for title, head, rows, note in grids(reports, names):
        console.print(f"\n[bold]{title}[/bold]", highlight=False)
        table = _rich_table(head, rows)
        if len(reports) > 1 and fit_columns(table, console) > console.width:
            table = _rich_table(head, [[label, *map(_stacked, cells)] for label, *cells in rows])
        print_table(table, console)
        if note:
            console.print(Padding(Text(note, style="dim"), (0, 0, 0, 2)))
    for remark in remarks(reports, names):
        console.print(remark, markup=False)
    return out.getvalue()


def _rich_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> RichTable:
    table = RichTable(box=box.SIMPLE_HEAD)
    for i, name in enumerate(head):
        table.add_column(name, justify="left" if i == 0 else "right")
    for cells in rows:
        table.add_row(*cells)
    return table


def _stacked(cell: str) -> str:
    """A comparison's cell (`v1 / v2 / v3 (n)`) with a line per value, for a table too wide with
    the values side by side: each figure stays whole."""
    return cell.replace(" / ", " /\n")


def to_markdown(reports: Sequence[Report], names: Sequence[str]) -> str:
    lines = [f"# {' vs '.join(r.title for r in reports)}", ""]
    for title, head, rows, note in grids(reports, names):
        lines += [
            f"## {title}",
            "",
            "| " + " | ".join(h.replace("|", "\\|") for h in head) + " |",
            "|" + "|".join("---" for _ in head) + "|",
        ]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        lines += (["", f"_{note}_"] if note else []) + [""]
    lines += [f"- {r}" for r in remarks(reports, names)]
    return "\n".join(lines) + "\n"


def to_json(reports: Sequence[Report], names: Sequence[str]) -> str:
    if len(reports) == 1:
        body: Any = report_dict(reports[0])
    else:
        body = {"compare": list(names), "reports": [report_dict(r) for r in reports]}
    return orjson.dumps(body, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n"


def report_dict(report: Report) -> dict[str, Any]:
    return {
        "title": report.title,
        "tables": [table_dict(t) for t in report.tables],
        "remarks": list(report.remarks),
        **report.extra,
    }


def table_dict(table: Table) -> dict[str, Any]:
    return {
        "key": table.key,
        "title": table.title,
        "columns": list(table.columns),
        "units": list(table.units),
        "n_label": table.n_label,
        "note": table.note,
        "rows": [{"label": r.label, "n": r.n, "values": list(r.values),
                  **({"unit": r.unit} if r.unit is not None else {})} for r in table.rows],
    }


Grid = tuple[str, list[str], list[list[str]], str]


def grids(reports: Sequence[Report], names: Sequence[str]) -> list[Grid]:
    """Each table as (title, header, rows of cells, note); two reports become one grid each."""
    if len(reports) == 1:
        return [
            (t.title, list(header(t)), [[r.label, str(r.n), *row_cells(t, r)] for r in t.rows], t.note)
            for t in reports[0].tables
        ]
    grids: list[Grid] = []
    for a, b in paired_tables(reports[0], reports[1]):
        head = [compact_legend(a), *names]
        rows = [[label, compact(a, ra), compact(b or a, rb)] for label, ra, rb in paired_rows(a, b)]
        if b is not None and a.note == b.note:
            note = a.note  # the same for both: said once
        else:
            note = "; ".join(f"{n}: {t.note}" for n, t in zip(names, (a, b), strict=True) if t and t.note)
        grids.append((a.title, head, rows, note))
    return grids


def remarks(reports: Sequence[Report], names: Sequence[str]) -> list[str]:
    if len(reports) == 1:
        return list(reports[0].remarks)
    return [f"{n}: {r}" for n, rep in zip(names, reports, strict=True) for r in rep.remarks]
