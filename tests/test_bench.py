"""The benchmarks' own parts: when the contention benchmark's short turns arrive, and what the
pieces benchmark measures on a real server."""

from __future__ import annotations

import asyncio

import pytest
from rich.table import Table

from proxy.bench.contention import Scenario
from proxy.bench.contention_cli import ranges_table
from proxy.bench.pieces import measure
from tests.conftest import StartLlamaServer


def test_random_arrivals_are_the_same_on_every_path_and_fall_at_any_phase() -> None:
    sc = Scenario(shorts=400, short_every_s=0.5)
    offsets = sc.short_offsets()
    assert offsets == Scenario(shorts=400, short_every_s=0.5).short_offsets()  # every path alike
    # one arrival in each 0.5 s window, at a different moment of it each time
    assert all(0.3 + 0.5 * i <= t < 0.3 + 0.5 * (i + 1) for i, t in enumerate(offsets))
    phases = [(t - 0.3) % 0.5 for t in offsets]
    assert min(phases) < 0.05 and max(phases) > 0.45
    assert len({round(p, 3) for p in phases}) > 200  # not a fixed rhythm


def test_periodic_arrivals_keep_a_fixed_rhythm() -> None:
    assert Scenario(shorts=3, short_every_s=0.6, arrivals="periodic").short_offsets() == \
        pytest.approx([0.3, 0.9, 1.5])


def test_an_unknown_arrival_pattern_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'bursty'"):
        Scenario(arrivals="bursty").short_offsets()


def test_an_unknown_set_up_is_refused_by_name_before_anything_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli.main import main

    assert main(["bench", "contention", "--setups", "np4,np9"]) == 2
    err = capsys.readouterr().err
    assert "unknown set-up np9" in err and "recommended" in err and "set-up np4" not in err


def test_each_piece_computes_only_its_own_tokens_on_top_of_the_cached_prefix(
        start_llama_server: StartLlamaServer) -> None:
    server = start_llama_server(lora=False, args=["-np", "3", "--no-cache-idle-slots"])
    figures = asyncio.run(measure(server.url, prefix=300, sizes=(16, 64), streams=1, seed=1))
    assert [(p.tokens, p.prefix) for p in figures.pieces] == [(16, 300), (64, 316)]
    assert all(0 < p.prompt_ms <= p.wall_ms for p in figures.pieces)
    assert len(figures.short_prompt_ms) == 2 and min(figures.short_prompt_ms) > 0


def test_ranges_over_runs_show_each_figures_lowest_and_highest() -> None:
    runs = [{"slotwise chunk": {"stream_rate_pct": 47.4, "shorts_over_1_5x": 4, "shorts": 12,
                                "cold_ttft_x": 2.13}},
            {"slotwise chunk": {"stream_rate_pct": 43.8, "shorts_over_1_5x": 2, "shorts": 12,
                                "cold_ttft_x": None}}]
    rows = {row[0]: row[1] for row in rendered_rows(ranges_table(runs))}
    assert rows["  as % of their rate alone"] == "43.8–47.4 %"
    assert rows["  short turns over 1.5 × uncontended p90"] == "2–4"
    assert rows["  as × alone"] == "2.13–2.13 ×"  # a run without the figure is left out
    assert rows["streams' longest gap (s)"] == "–"


def rendered_rows(table: Table) -> list[tuple[str, str]]:
    labels, values = (list(column.cells) for column in table.columns)
    return list(zip(labels, values, strict=True))
