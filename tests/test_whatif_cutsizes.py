"""The sizes of requests whose client left before llama-server said them, read from the server
log's own lines (proxy/whatif/cutsizes.py), and what the what-if does with them: a request the
recording cut mid-prompt is replayed with its size, not a guess. Hand-written log lines in
llama-server's format (tests/test_whatif_serverobs.py's helpers), times in plain seconds.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.report.serverlog import parse_server_log
from proxy.whatif.cutsizes import cut_sizes, seen_by_task
from proxy.whatif.predict import Inputs, predict
from proxy.whatif.synth import loaded, record
from tests.test_whatif_serverobs import slot, task_lines, tasks_of


def cut(rid: str, t: float, total_ms: float) -> dict[str, Any]:
    """A request whose client left after `total_ms`, before any timings came."""
    return {**record(rid, t, "b", 1, 0, 0), "outcome": "client_gone", "timings": None,
            "prompt_tokens": None, "computed_tokens": None, "events": 0, "total_ms": total_ms}


def sizes(lines: list[str], records: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    lines = sorted(lines, key=lambda s: tuple(int(x) for x in s.split(" ", 1)[0].split(".")))
    events = parse_server_log(lines).events
    return cut_sizes(tasks_of(lines), loaded(records), seen_by_task(events, lines))


def timed(rid: str, t: float) -> dict[str, Any]:
    """A finished request of 500 new tokens and 20 generated: the log and the records share it,
    which sets their clocks apart."""
    return {**record(rid, t, "a", 500, 0, 20), "total_ms": 1500.0}


class TestCutSizes:
    def test_a_prompt_cut_mid_way_is_sized_by_its_progress_line(self) -> None:
        lines = [*task_lines(0, 1, 0.0, 500, 500.0, 0, 20, 1000.0),
                 slot(10.0, 1, 2, "launch_slot_", "processing task, is_child = 0"),
                 slot(14.0, 1, 2, "print_timing", "prompt processing, n_tokens =   2046, "
                      "progress = 0.50, t =   4.00 s / 511.50 tokens per second")]
        assert sizes(lines, [timed("a", 0.0), cut("gone", 10.0, 8000.0)]) == {"gone": (4092, 0)}

    def test_a_slot_chosen_by_similarity_says_the_cached_part_and_the_prompt(self) -> None:
        lines = [*task_lines(0, 1, 0.0, 500, 500.0, 0, 20, 1000.0),
                 slot(20.0, 0, -1, "get_availabl", "selected slot by LCP similarity, f_sim_best = "
                      "0.900 (> 0.100 thold), f_keep = 0.950"),
                 slot(20.0, 0, 3, "launch_slot_", "processing task, is_child = 0")]
        got = sizes(lines, [timed("a", 0.0), cut("back", 20.0, 3000.0)])
        held = round(0.95 * 519)  # the slot's 519 tokens (500 + 20 - 1) at its release
        assert got == {"back": (pytest.approx(held / 0.9, abs=1), held)}

    def test_a_request_no_task_of_the_log_ran_keeps_no_size(self) -> None:
        lines = task_lines(0, 1, 0.0, 500, 500.0, 0, 20, 1000.0)
        assert sizes(lines, [timed("a", 0.0), cut("queued", 10.0, 8000.0)]) == {}

    def test_without_a_request_both_logs_show_nothing_is_sized(self) -> None:
        lines = [slot(10.0, 1, 2, "launch_slot_", "processing task, is_child = 0"),
                 slot(14.0, 1, 2, "print_timing", "prompt processing, n_tokens =   2046, "
                      "progress = 0.50, t =   4.00 s / 511.50 tokens per second")]
        assert sizes(lines, [cut("gone", 10.0, 8000.0)]) == {}


class TestReplayed:
    def test_a_request_cut_mid_prompt_is_replayed_with_its_size_not_a_guess(self) -> None:
        lines = sorted([*task_lines(0, 1, 0.0, 500, 500.0, 0, 20, 1000.0),
                        slot(10.0, 1, 2, "launch_slot_", "processing task, is_child = 0"),
                        slot(14.0, 1, 2, "print_timing", "prompt processing, n_tokens =   2046, "
                             "progress = 0.50, t =   4.00 s / 511.50 tokens per second")],
                       key=lambda s: tuple(int(x) for x in s.split(" ", 1)[0].split(".")))
        records = loaded([timed("a", 0.0), cut("gone", 10.0, 8000.0)])
        prediction = predict(Inputs(records, server_log=lines))
        job = next(j for j in prediction.workload.jobs if j.id == "gone")
        assert "gone" not in prediction.workload.guessed
        assert job.prompt.length == 4092
