"""A bounded soak: tens of seconds of mixed traffic through a `slotwise serve` process in front of a
fake llama-server, with slow, leaving and bad clients, silent sockets and upstream faults, and a long
stream always open beside them. `slotwise bench soak` runs the same for longer."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.bench.soak import run


@pytest.mark.slow
def test_a_mixed_soak_leaves_one_record_per_request_and_memory_levels_off(tmp_path: Path) -> None:
    figures = run(24, clients=10, work_dir=tmp_path)
    assert figures.sent > 2000 and len(figures.requests) == 12  # each kind that makes a request
    assert figures.records == figures.sent and figures.lost == 0
    assert figures.unexpected_count == 0, figures.unexpected
    assert figures.silent_closed == figures.silent_sockets > 0
    outcomes = figures.outcomes
    assert {"done", "client_gone", "upstream_error", "bad_request"} <= set(outcomes)
    growth = figures.rss_at(1.0) - figures.rss_at(0.5)
    assert growth < 4.0, f"RSS grew {growth:.1f} MB over the second half: {figures.rss_mb}"
