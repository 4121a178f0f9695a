"""Tables that never cut a figure: the benchmarks' and the demo's, at 80 columns and piped."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table

from proxy.bench.cli import overhead_table
from proxy.bench.cluster import ClusterFigures, cluster_table
from proxy.bench.contention import Baseline
from proxy.bench.contention_cli import estimate_table, ranges_table, render
from proxy.bench.harness import StreamResult
from proxy.bench.keep import budget_table, returning_table
from proxy.bench.keep_run import KeepFigures, KeepScenario, Turn
from proxy.bench.output import figures_table, print_table
from proxy.bench.overhead import OverheadFigures
from proxy.bench.pieces import PieceCost, PieceFigures
from proxy.bench.pieces_cli import pieces_table
from proxy.bench.soak import SoakFigures
from proxy.bench.soak_cli import soak_table
from proxy.bench.warm import WarmFigures, WarmScenario, Window
from proxy.bench.warm_cli import warm_table
from proxy.cli.demo import records_table, summary_table


def printed(table: Table, width: int = 80) -> str:
    """What `print_table` writes to a console of `width` columns that is not a terminal."""
    out = io.StringIO()
    print_table(table, Console(file=out, width=width))
    return out.getvalue()


def wide_table(columns: int) -> Table:
    table = figures_table("wide numbers")
    table.add_column("what it is")
    for i in range(columns):
        table.add_column(f"figure {i}", justify="right")
    table.add_row("a row whose label is long enough to wrap",
                  *(f"{1_234_567.8 * (i + 1):,.1f} ms" for i in range(columns)))
    return table


@pytest.mark.parametrize("columns", [1, 4, 8])
def test_wide_numbers_at_80_columns_are_never_cut(columns: int) -> None:
    text = printed(wide_table(columns))
    assert "…" not in text
    assert all(f"{1_234_567.8 * (i + 1):,.1f} ms" in text for i in range(columns))
    if columns <= 4:  # these fit: the lines stay within the 80 columns
        assert max(len(line) for line in text.splitlines()) <= 80


def test_a_table_too_wide_for_the_console_is_printed_whole_not_cut() -> None:
    text = printed(wide_table(12), width=40)
    assert "…" not in text
    assert all(f"{1_234_567.8 * (i + 1):,.1f} ms" in text for i in range(12))


def record(client: str, purpose: str, queue_ms: float = 14_100.2) -> dict[str, object]:
    return {"start": client, "client": client, "purpose": purpose, "prompt_tokens": 32_252,
            "timings": {"prompt_n": 13_252}, "queue_ms": queue_ms, "ttft_ms": 110_912.3,
            "warmed_tokens": 31_000, "events": 1_200, "gap_max_ms": 2_300.6, "worst_3s_rate": 45.45,
            "prefill_plan": "chunked",
            "overlaps": [{"computed_tokens": 3252, "decode_ms": 2000.0, "decode_events": 90}]}


def test_the_demo_records_table_keeps_every_figure_at_80_columns() -> None:
    records = [record("dan", "first-turn"), record("ann", "chat"), record("dan", "warm-up", 340.0)]
    text = printed(records_table("warm", records))
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for figure in ("32,252", "13,252", "31,000", "14.1 s", "111 s", "1,200", "2.3 s", "45"):
        assert text.count(figure) >= 2, figure
    assert "340 ms" in text  # a time under a second, as the report shows it


def test_the_demo_summary_keeps_every_figure_at_80_columns() -> None:
    felt = [("ann", StreamResult(sent=0.0, tokens=[0.01 * i for i in range(1, 700)])),
            ("dan", StreamResult(sent=0.8, tokens=[110.9])),
            ("eve", StreamResult(sent=1.2, tokens=[5.3]))]
    text = printed(summary_table({"off": felt, "chunk": felt, "defer": felt}))
    assert "…" not in text and text.count("110 s") == 3 and text.count("4.1 s") == 3
    assert max(len(line) for line in text.splitlines()) <= 80


FIGURES = {"stream_rate": 48.1, "stream_rate_pct": 47.4, "stream_max_gap_s": 2.25,
           "short_ttft_p50_s": 1.504, "short_ttft_p90_s": 13.637, "short_ttft_p90_x": 170.5,
           "shorts_over_1_5x": 9, "shorts": 12, "cold_ttft_s": 114.43, "cold_ttft_x": 3.15,
           "tokens_per_s": 12_217.5,
           "estimates": [{"purpose": "chunked", "est_prompt": 32_264, "est_new": 32_259,
                          "prompt_n": 130, "cache_n": 32_134, "pieces": 150, "held_ms": 110_700.0,
                          "note": "cold, nobody generating"}]}


def test_the_contention_tables_keep_every_figure_at_80_columns() -> None:
    results = {path: FIGURES for path in ("direct", "defer", "chunk", "b512")}
    bases = {"default": Baseline(101.5, [0.05, 0.052], 4.6, cold_alone=(4.6, 6.9, 4.1))}
    for table in (render(results, bases), estimate_table(results), ranges_table([results] * 2)):
        text = printed(table)
        assert "…" not in text
        assert max(len(line) for line in text.splitlines()) <= 80
    assert printed(render(results, bases)).count("170.50 ×") == 4
    assert "beside 3 generating streams" in printed(render(results, bases))
    # the cold prompt alone, timed three times: its median, and each timing said
    assert "cold alone 4.60 s (median of 4.60, 6.90, 4.10)" in " ".join(
        printed(render(results, bases)).split())
    assert "beside one generating stream" in printed(render(results, bases, streams=1))
    assert printed(estimate_table(results)).count("32,264") == 4
    assert printed(ranges_table([results] * 2)).count("13.637–13.637") == 4


def test_the_pieces_table_keeps_every_figure_at_80_columns() -> None:
    pieces = PieceFigures(streams=3, short_prompt_ms=[35.0],
                          pieces=[PieceCost(25_600, 123_000, 5_780.5, 6_012.3)])
    text = printed(pieces_table(pieces, "testbed small model"))
    assert "…" not in text
    assert all(f in text for f in ("25,600", "123,000", "5780.5", "6012.3", "165.2 ×"))


def test_an_indented_label_keeps_its_first_word_whole() -> None:
    table = figures_table()
    table.add_column("")
    table.add_column("figure", justify="right")
    table.add_row("  restored from a file (tokens)", "1,234,567,890,123,456,789,012,345,678,901")
    text = printed(table, width=50)
    assert "  restored" in text and "restor\n" not in text


def bench_tables() -> dict[str, Table]:
    """Every other benchmark's table, with figures as wide as a real run's."""
    day_two = [Turn(1.04, 5_012, 98, 4_914)] * 20
    return {
        "overhead": overhead_table(OverheadFigures(12.34, 13.56, 1.22, 12_345.0, 12_001.0,
                                                   1_234_567, 12.34, 100_045.0)),
        "cluster": cluster_table(ClusterFigures(123.45, 130.12, 6.67, 3.21, 40, 2_000)),
        "keep returning": returning_table(KeepFigures(Turn(1.23, 23_456, 123, 23_333, 0.34),
                                                      Turn(35.6, 23_456, 23_456, 0, 1.2), 36.1),
                                          KeepScenario(), "small"),
        "keep budget": budget_table(KeepFigures(budgets={"all": day_two, "10": day_two}),
                                    KeepScenario()),
        "warm": warm_table(WarmFigures(12_345, 35.6, 1.2, 1.5, 20.1, 0.97, 12_000, 45.6,
                                       Window(12.3, 40.1, 0.45), Window(12.3, 30.1, 0.9), 0.2, 0.5,
                                       [{"outcome": "done", "pieces": 12}]), WarmScenario()),
        "soak": soak_table(SoakFigures(600.0, 123_456, 123_456, {"chat": 100_000, "completion": 23_456},
                                       {"done": 120_000, "client_gone": 3_456}, 1_234, 1_234, 0, [],
                                       [(0.0, 80.5), (300.0, 95.1), (600.0, 95.3)])),
    }


@pytest.mark.parametrize("name", list(bench_tables()))
def test_every_benchmarks_table_fits_80_columns(name: str) -> None:
    text = printed(bench_tables()[name])
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
