"""Tables that never cut a figure, for every command that prints one (report, analyze-log, the
benchmarks, the demo), in an 80-column terminal or piped.

rich shrinks a table that is wider than the console by cutting cells ("3,2…"), so `print_table`
lays the columns out itself: every column gets at least its longest word, a right-aligned column
(figures) its longest cell, the room left goes to the columns that wrap most, and a console too
narrow even for that is widened.
"""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.table import Column, Table

UNBOUNDED = 1 << 16
"""A console width no table reaches: measures a table's natural layout."""
COMPACT = (0, 0, 0, 0)
"""Cell padding of a table too wide for padding: the rules' own space separates the columns."""


def print_table(table: Table, console: Console | None = None) -> None:
    """Print `table` with no word cut: wrapped at spaces if the console is narrow, never inside a
    word, and on a console narrower than its longest words side by side, wider than the console
    (a terminal wraps those lines; a pipe or a file gets them whole)."""
    console = console or Console()
    width = fit_columns(table, console)
    if width <= console.width:
        console.print(table)
        return
    normal = console.width
    console.width = width
    try:
        console.print(table)
    finally:
        console.width = normal


def fit_columns(table: Table, console: Console) -> int:
    """Fix each column's width for `console` so that no word is cut; return the table's width.
    A table that does not fit with padded columns loses the padding (one space between columns)."""
    least = [_least(console, column) for column in table.columns]
    most = [max(_measure(console, cell).maximum for cell in [column.header, *column.cells])
            for column in table.columns]
    chrome = _width_at(table, console, least) - sum(least)
    if sum(least) + chrome > console.width and table.padding != COMPACT:
        table.padding = COMPACT
        chrome = _width_at(table, console, least) - sum(least)
    widths = _share(least, most, console.width - chrome)
    for column, width in zip(table.columns, widths, strict=True):
        column.width, column.overflow = width, "fold"
    return sum(widths) + chrome


def _least(console: Console, column: Column) -> int:
    """The narrowest a column may be: its longest word; a right-aligned column holds figures with
    their units ("47.4 %", "9 of 12"), which stay on one line."""
    header = _measure(console, column.header).minimum
    sizes = [_measure(console, cell) for cell in column.cells]
    whole = column.justify == "right"
    least = [size.maximum if whole else size.minimum for size in sizes]
    return max([header, *least, *(_indented(cell) for cell in column.cells)])


def _indented(cell: Any) -> int:
    """An indented label ("  median") keeps its indentation with its first word, which rich's
    measure leaves out."""
    if not isinstance(cell, str) or not cell.startswith(" ") or not cell.strip():
        return 0
    text = cell.lstrip(" ")
    return cell_len(cell) - cell_len(text) + cell_len(text.split(maxsplit=1)[0])


def _measure(console: Console, renderable: Any) -> Measurement:
    return Measurement.get(console, console.options.update_width(UNBOUNDED), renderable)


def _width_at(table: Table, console: Console, widths: list[int]) -> int:
    """The table's width with these column widths: the columns plus borders and padding."""
    for column, width in zip(table.columns, widths, strict=True):
        column.width = width
    return _measure(console, table).maximum


def _share(least: list[int], most: list[int], room: int) -> list[int]:
    """Column widths from their least, each widened toward its most while `room` lasts, one
    character at a time to the column furthest from its most (so long texts wrap least)."""
    widths = list(least)
    spare = room - sum(widths)
    while spare > 0:
        want = [m - w for w, m in zip(widths, most, strict=True)]
        i = max(range(len(widths)), key=want.__getitem__)
        if want[i] <= 0:
            break
        widths[i] += 1
        spare -= 1
    return widths
