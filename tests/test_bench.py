"""The benchmarks' own parts: when the contention benchmark's short turns arrive, and what the
pieces benchmark measures on a real server."""

from __future__ import annotations

import asyncio

import pytest

from proxy.bench.contention import Scenario
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


def test_each_piece_computes_only_its_own_tokens_on_top_of_the_cached_prefix(
        start_llama_server: StartLlamaServer) -> None:
    server = start_llama_server(lora=False, args=["-np", "3", "--no-cache-idle-slots"])
    figures = asyncio.run(measure(server.url, prefix=300, sizes=(16, 64), streams=1, seed=1))
    assert [(p.tokens, p.prefix) for p in figures.pieces] == [(16, 300), (64, 316)]
    assert all(0 < p.prompt_ms <= p.wall_ms for p in figures.pieces)
    assert len(figures.short_prompt_ms) == 2 and min(figures.short_prompt_ms) > 0
