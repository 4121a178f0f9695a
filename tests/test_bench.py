"""The benchmarks' own parts: when the contention benchmark's short turns arrive, the timing log it
keeps of a direct path (what `slotwise whatif` reads), and what the pieces benchmark measures on a
real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rich.table import Table

from proxy.bench.calls import client_log
from proxy.bench.contention import Scenario, play
from proxy.bench.contention_cli import ranges_table
from proxy.bench.kv import LAYOUTS, run_layouts
from proxy.bench.pieces import measure
from proxy.report.records import load_timing_log
from proxy.testbed.model import ModelFiles
from proxy.whatif.check import SHORT_TOKENS, Kind, counted
from proxy.whatif.predict import Inputs, predict
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


def test_a_direct_path_is_kept_as_a_timing_log_the_what_if_replays(
        start_llama_server: StartLlamaServer, tmp_path: Path) -> None:
    """Every request of a direct path gets one record, named as on every other path (so a what-if
    of one path can be checked against another), with the sizes the server said."""
    server = start_llama_server(lora=False, args=["-np", "3", "-c", "4096"])
    sc = Scenario(streams=1, stream_tokens=24, cold_words=240, lead_s=0.3, shorts=2,
                  short_every_s=0.3)
    run = asyncio.run(play(server.url, sc, "direct", cold_seed=5))
    path = tmp_path / "client-direct.jsonl"
    path.write_bytes(client_log(run.calls, run.wall_offset))
    records = list(load_timing_log(str(path)).records)
    assert sorted(r["id"] for r in records) == ["cold", "short-0", "short-1", "user0-0"]
    by_id = {r["id"]: r for r in records}
    assert [by_id[i]["client"] for i in ("cold", "short-0", "user0-0")] == \
        ["returning", "short-0", "user0"]
    cold = by_id["cold"]
    assert cold["prompt_tokens"] == cold["computed_tokens"] >= SHORT_TOKENS
    assert cold["ttft_ms"] > 0 and by_id["user0-0"]["events"] == 24
    assert counted(records, cold_tokens=SHORT_TOKENS)["cold"] is Kind.COLD
    lines = server.log_path.read_text().splitlines()
    again = predict(Inputs(records, server_log=lines, sets=("n_batch=512",)))
    assert sorted(r.id for r in again.outcome.records) == sorted(by_id)


def test_the_kv_benchmark_times_the_streams_before_and_after_a_long_prompt(
        llama_server_binary: Path, tiny_model: ModelFiles) -> None:
    """Both layouts on their own servers, every erase answered (llama-server erases a slot only
    with a slot save path: without it every erase answered 501 and nothing was erased)."""
    both = run_layouts(list(LAYOUTS), long_words=120, stream_tokens=16, rounds=2,
                       binary=llama_server_binary, model=tiny_model.model, say=lambda _: None)
    assert [f.layout for f in both] == ["shared", "per-slot"]
    figures = both[0]
    assert len(figures.before_ms) == 2 and figures.before > 0
    assert 400 < figures.long_tokens < 1000 and figures.long_ms > 0  # one prompt, computed whole
    assert min(figures.held_ms, figures.slot_erased_ms, figures.all_erased_ms) > 0


def test_an_unknown_kv_layout_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.cli.main import main

    assert main(["bench", "kv", "--layouts", "shared,split"]) == 2
    assert "unknown layout split" in capsys.readouterr().err


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
