"""How the benchmarks and the demo print: tables with little chrome, laid out by
proxy/report/fit.py so that no figure is cut, and their JSON (the argument type their options share is
`proxy/testbed/args.py`'s).
"""

from __future__ import annotations

from typing import Any

import orjson
from rich import box
from rich.table import Table

from proxy.report.cells import fmt
from proxy.report.fit import print_table as print_table  # the benchmarks and the demo import it here


def figures_table(title: str | None = None) -> Table:
    """A table with little chrome (no outer edge, no vertical rules), so more fits in 80 columns."""
    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)


def show(table: Table, figures: dict[str, Any], *, as_json: bool) -> int:
    """Print a benchmark's table, and its figures as JSON if asked; the command's exit status."""
    print_table(table)
    if as_json:
        print(orjson.dumps(figures, option=orjson.OPT_INDENT_2).decode())
    return 0


def seconds(value: float | None) -> str:
    """A time in seconds for a table, as the reports show one (`proxy/report/cells.py`: under a
    second in ms); "–" when it was not measured."""
    return "–" if value is None else fmt(value, "s")


def percent(share: float | None) -> str:
    """A share (0-1) as a whole percentage for a table ("–" when it was not measured)."""
    return "–" if share is None else f"{100 * share:.0f} %"
