"""The summary of `slotwise bench contention --setups`: one row per set-up and path with the issue's
figures (what the streams keep, their longest gap, a short turn's wait, the cold request's time, and
what both keep), the median over the runs."""

from __future__ import annotations

import statistics
from typing import Any

from rich.table import Table

from proxy.bench.output import figures_table

SUMMARY: tuple[tuple[str, str], ...] = (
    ("streams %", "{:.0f}"), ("gap s", "{:.2f}"), ("short p90 +ms", "{:+.0f}"),
    ("cold ×", "{:.2f}"), ("share+1/cold×", "{:.2f}"),
)


def summary_figures(fig: dict[str, Any]) -> dict[str, float | None]:
    """The issue's figures of one path: streams' share, their longest gap, a short turn's p90 over
    uncontended, the cold request against alone, and what both keep (share + 1/cold×)."""
    share = fig["stream_rate_pct"] / 100.0 if fig["stream_rate_pct"] is not None else None
    cold = fig["cold_ttft_x"]
    p90, base = fig["short_ttft_p90_s"], fig["short_ttft_uncontended_p90_s"]
    return {"streams %": None if share is None else 100.0 * share,
            "gap s": fig["stream_max_gap_s"],
            "short p90 +ms": None if p90 is None or base is None else 1000.0 * (p90 - base),
            "cold ×": cold,
            "share+1/cold×": None if share is None or not cold else share + 1.0 / cold}


def setups_table(every: list[dict[str, Any]], prefill: dict[str, Any]) -> Table:
    """One row per set-up and path; with several runs, each figure's median over them."""
    runs = len(every)
    what = f"median of {runs} runs" if runs > 1 else "one run"
    table = figures_table(f"set-ups side by side ({what}, each against its own baselines)")
    for column in ("set-up", "path", *(label for label, _ in SUMMARY)):
        table.add_column(column, justify="left" if column in ("set-up", "path") else "right")
    for name in every[0]:
        for path in every[0][name]["results"]:
            cells = []
            for label, fmt in SUMMARY:
                values = [summary_figures(run[name]["results"][path])[label] for run in every
                          if path in run.get(name, {}).get("results", {})]
                present = [v for v in values if v is not None]
                cells.append(fmt.format(statistics.median(present)) if present else "–")
            table.add_row(name, path, *cells)
    table.caption = (f"max_stall_ms {prefill.get('max_stall_ms', 'default')}; short p90 +ms: short "
                     "turns' p90 time to first token minus their uncontended p90")
    return table
