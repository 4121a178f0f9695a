"""The set-ups summary of `bench contention --setups`: the issue's figures per path, medians of runs."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from proxy.bench.output import print_table
from proxy.bench.setups_table import setups_table, summary_figures


def fig(pct: float, gap: float, cold: float) -> dict[str, Any]:
    return {"stream_rate_pct": pct, "stream_max_gap_s": gap, "cold_ttft_x": cold,
            "short_ttft_p90_s": 0.2, "short_ttft_uncontended_p90_s": 0.05}


def test_what_both_keep_is_the_streams_share_plus_the_cold_requests() -> None:
    got = summary_figures(fig(45.0, 0.2, 2.0))
    assert got["share+1/cold×"] == 0.45 + 0.5
    assert round(got["short p90 +ms"] or 0) == 150


def test_a_missing_figure_is_a_dash_not_an_error() -> None:
    got = summary_figures({**fig(45.0, 0.2, 2.0), "stream_rate_pct": None})
    assert got["streams %"] is None and got["share+1/cold×"] is None


def test_each_figure_is_the_median_of_the_runs() -> None:
    runs = [{"np4": {"results": {"chunk": fig(p, 0.2, 2.0)}}} for p in (40.0, 50.0, 60.0)]
    console = Console(width=80, record=True)
    print_table(setups_table(runs, {"max_stall_ms": 160}), console)
    text = console.export_text()
    assert "median of 3 runs" in text
    (row,) = [line for line in text.splitlines() if line.startswith("np4")]
    assert row.split()[2] == "50" and row.split()[-1] == "1.00"
