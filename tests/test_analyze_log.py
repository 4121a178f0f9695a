"""`slotwise analyze-log`: the line parser, the task rebuild and the tables, on hand-made excerpts
built from the formats in llama-server-notes.md section 6."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.report import task_tables
from proxy.report.pairing import pair
from proxy.report.serverlog import (
    NO_PREFIX,
    SERVER_LINES,
    STARTUP,
    TASK_LINES,
    UNRECOGNISED,
    parse_server_log,
)
from proxy.report.tasks import rebuild_tasks

DATA = Path(__file__).parent / "data"
EXCERPT = DATA / "server-excerpt.log"


def excerpt_tasks() -> list:  # type: ignore[type-arg]
    return rebuild_tasks(parse_server_log(EXCERPT.read_text().splitlines()).events)


def test_timestamp_is_minutes_seconds_millis_micros() -> None:
    log = parse_server_log(
        ["3517.09.125.958 I slot launch_slot_: id  3 | task 7 | processing task, is_child = 0"]
    )
    assert log.events[0].t == pytest.approx(3517 * 60 + 9.125958)
    assert (log.events[0].slot, log.events[0].task) == (3, 7)


def test_every_line_is_counted() -> None:
    log = parse_server_log(EXCERPT.read_text().splitlines())
    assert sum(log.counts.values()) == log.lines == 46
    assert log.counts[UNRECOGNISED] == 0
    assert log.counts[NO_PREFIX] == 1 and log.counts[STARTUP] == 3
    assert log.counts[SERVER_LINES] == 4 and log.counts[TASK_LINES] == 35


def test_unknown_slot_lines_are_reported() -> None:
    log = parse_server_log(["0.01.000.000 I slot frobnicate_: id  0 | task 1 | splines reticulated"])
    assert log.counts[UNRECOGNISED] == 1
    assert log.unrecognised == [(1, "splines reticulated")]


def test_tasks_rebuilt_on_the_time_axis() -> None:
    tasks = {t.task: t for t in excerpt_tasks()}
    assert sorted(tasks) == [0, 5, 9]
    long = tasks[5]
    assert (long.slot, long.prompt_n, long.predicted_n) == (1, 20000, 20)
    assert long.start_s == pytest.approx(16.95)
    assert long.prefill_start_s == pytest.approx(17.0)
    assert long.decode_start_s == pytest.approx(37.0)
    assert long.end_s == pytest.approx(38.0)
    assert long.selected_by == "LRU"
    assert tasks[9].cache_n == 1000 and tasks[9].selected_by == "LCP similarity"
    assert len(tasks[0].tg) == 9


def test_slot_switches_that_stall_the_server_are_counted_by_how_the_slot_was_chosen() -> None:
    tasks = {t.task: t for t in excerpt_tasks()}
    assert tasks[0].slot_switch_ms == pytest.approx(10.0)  # chosen at 9.990 s, started at 10.000
    assert tasks[5].slot_switch_ms == pytest.approx(50.0)
    rows = {r.label: r for r in task_tables.slot_switch_table(list(tasks.values())).rows}
    lru, lcp = rows["selected by LRU"], rows["selected by LCP similarity"]
    assert lru.n == 2 and lru.values == pytest.approx((1, 50.0, 50.0, 0.05))  # one over 20 ms
    assert lcp.n == 1 and lcp.values[0] == 0 and lcp.values[1] is None


def test_tg3s_during_a_long_prefill_versus_otherwise() -> None:
    rows = {r.label: r for r in task_tables.tg3s_table(excerpt_tasks(), 15000).rows}
    during = rows["while another slot prefilled >= 15,000 tokens"]
    assert during.n == 5 and during.values[0] == pytest.approx(1.61)
    # 16.1-19.2 and 34.7-37.8 straddle the prefill's start (17.0) and end (37.0).
    assert rows["window partly inside such a prefill"].n == 2
    assert rows["otherwise"].n == 2 and rows["otherwise"].values[0] == pytest.approx(50.0)


def test_prefill_speed_by_step_size() -> None:
    rows = task_tables.prefill_steps_table(excerpt_tasks()).rows
    assert [(r.label, r.n, r.values) for r in rows] == [("1,500 or more", 7, (1000.0,))]


def test_task_seen_without_start_and_server_restart() -> None:
    lines = [
        "0.05.000.000 I slot print_timing: id  0 | task 3 | n_gen =    200, tg =  10.00 t/s, "
        "tg_3s =  10.00 t/s",
        "0.06.000.000 I slot      release: id  0 | task 3 | stop processing: n_tokens = 9, truncated = 0",
        "0.00.100.000 I build: 1 (x)",
        "0.01.000.000 I slot launch_slot_: id  0 | task 3 | processing task, is_child = 0",
    ]
    log = parse_server_log(lines)
    tasks = rebuild_tasks(log.events)
    assert log.runs == 2
    assert [(t.run, t.seen_start) for t in tasks] == [(1, False), (2, True)]


def test_pairing_with_timing_records_adds_the_queue_wait() -> None:
    tasks = excerpt_tasks()
    server_start = 1_762_312_800.0
    # The request for task 5 arrived 3 s before its slot started the prefill at 17.0 s.
    record = {
        "id": "req-5",
        "start": "",
        "_t0": server_start + 14.0,
        "prefill_wait_ms": 3000.0,
        "ttft_ms": 23000.0,
        "total_ms": 24000.0,
        "client": "ann",
        "lora_out": None,
        "timings": {"prompt_n": 20000, "predicted_n": 20, "prompt_ms": 20000.0, "predicted_ms": 1000.0},
    }
    spans, paired, offset = pair(tasks, [record])
    assert paired == 1 and offset == pytest.approx(server_start)
    span = next(s for s in spans if s.key == "task 5")
    assert span.wait_s == pytest.approx(3.0) and span.client == "ann"


def test_cli_json_lists_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze-log", str(EXCERPT), "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["unrecognised_lines"] == 0
    assert [t["task"] for t in body["tasks"]] == [0, 5, 9]
    first = body["tasks"][0]
    for key in ("slot", "task", "start_s", "end_s", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms"):
        assert key in first


def test_cli_text_and_timing_pairing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    timing = tmp_path / "t.jsonl"
    timing.write_text(
        json.dumps(
            {
                "id": "r",
                "start": "2025-11-05T03:20:14.000Z",
                "kind": "chat",
                "outcome": "done",
                "prefill_wait_ms": 3000.0,
                "ttft_ms": 23000.0,
                "total_ms": 24000.0,
                "timings": {
                    "prompt_n": 20000,
                    "predicted_n": 20,
                    "prompt_ms": 20000.0,
                    "predicted_ms": 1000.0,
                },
            }
        )
        + "\n"
    )
    assert main(["analyze-log", str(EXCERPT), "--timing", str(timing)]) == 0
    out = capsys.readouterr().out
    assert "paired 1 of 3 server tasks" in out
    assert "while another slot prefilled >= 15,000 tokens" in out


def test_cli_log_of_another_format_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "plain.log"
    log.write_text("slot launch_slot_: id  0 | task 1 | processing task\nhello\n")
    assert main(["analyze-log", str(log)]) == 1
    err = capsys.readouterr().err
    assert "timestamp prefix" in err and err.count("\n") == 1


def test_cli_missing_log(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze-log", "/nonexistent.log"]) == 1
    assert "cannot read server log" in capsys.readouterr().err
