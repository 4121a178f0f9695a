"""`slotwise report`: aggregation on hand-made timing records, the loader, renderers and CLI."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.report import record_tables, tables
from proxy.report.model import Table
from proxy.report.records import (
    InputError,
    is_turn,
    load_timing_log,
    new_tokens,
    record_to_span,
)
from proxy.report.spanindex import SpanIndex
from proxy.report.stall_table import stalls_table
from proxy.report.tables import Thresholds

T0 = 1_762_312_800.0  # 2025-11-05T03:20:00Z


def rec(
    id: str,
    at: float,
    total: float,
    *,
    wait: float = 0.1,
    prefill: float = 0.2,
    prompt_n: int = 100,
    cache_n: int = 0,
    predicted_n: int = 50,
    decode: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A timing record: times in seconds from T0; decode defaults to the rest of the total."""
    decode = total - wait - prefill if decode is None else decode
    record = {
        "id": id,
        "start": datetime.fromtimestamp(T0 + at, UTC).isoformat(timespec="milliseconds"),
        "kind": "chat",
        "outcome": "done",
        "stream": True,
        "total_ms": total * 1000,
        "prefill_wait_ms": wait * 1000,
        "ttft_ms": (wait + prefill) * 1000,
        "decode_ms": decode * 1000,
        "events": predicted_n,
        "timings": {
            "prompt_n": prompt_n,
            "cache_n": cache_n,
            "prompt_ms": prefill * 1000,
            "predicted_n": predicted_n,
            "predicted_ms": decode * 1000,
        },
        "lora_out": None,
        "lora_rewritten": False,
        "inflight_at_start": [],
        "overlaps": [],
        "prefill_plan": "none",
        "held_ms": 0.0,
        "pieces": 0,
    }
    record.update(extra)
    record["_t0"] = T0 + at
    return record


def table(t: Table) -> dict[str, tuple[int, tuple[float | None, ...]]]:
    return {r.label: (r.n, r.values) for r in t.rows}


def spans_of(*records: dict[str, Any]) -> tuple[list[Any], SpanIndex]:
    spans = [record_to_span(r) for r in records]
    return spans, SpanIndex(spans)


def test_turns_split_by_cache_hit_size_and_purpose() -> None:
    spans, _ = spans_of(
        rec("a", 0, 10, prompt_n=10, cache_n=990, purpose="chat"),
        rec("b", 100, 20, prompt_n=6000, cache_n=0, purpose="chat"),
        rec("c", 200, 30, prompt_n=500, cache_n=500, purpose="summary"),
    )
    rows = table(tables.turns_table(spans, Thresholds()))
    assert rows["all turns"] == (3, (20.0, pytest.approx(29.0), 30.0))
    assert rows["of which >= 95% cached"] == (1, (10.0, 10.0, 10.0))
    assert rows["of which >= 5,000 new tokens"][0] == 1
    assert rows["purpose summary"] == (1, (30.0, 30.0, 30.0))


def test_time_split_uses_the_rates_of_requests_that_ran_alone() -> None:
    alone = rec("a", 0, 3.0, wait=0.0, prefill=1.0, prompt_n=800, predicted_n=100, decode=2.0)
    # b and c overlap: b took 10 s for 800 + 100 tokens that alone would take 1 + 2 s.
    b = rec("b", 100, 10.0, wait=0.0, prefill=1.0, prompt_n=800, predicted_n=100)
    c = rec("c", 101, 3.0, wait=0.0, prefill=1.0, prompt_n=800, predicted_n=100, decode=2.0)
    spans, index = spans_of(alone, b, c)
    t = tables.time_split_table(spans, index)
    rows = table(t)
    assert rows["own decode"][1][0] == pytest.approx(6.0)
    assert rows["own prefill"][1][0] == pytest.approx(3.0)
    assert rows["increment caused by others (waits, shared steps)"][1][0] == pytest.approx(7.0)
    assert "decode 50.0 tok/s, prefill 800 tok/s" in t.note


def test_time_split_without_any_lone_request_takes_the_fastest_rates_as_a_bound() -> None:
    # a and b overlap all the time: a decoded 100 tokens in 2 s, prefilled 800 in 1 s; b was slower
    a = rec("a", 0, 10, wait=0.0, prefill=1.0, prompt_n=800, predicted_n=100, decode=2.0)
    b = rec("b", 1, 10, wait=0.0, prefill=4.0, prompt_n=800, predicted_n=100, decode=4.0)
    spans, index = spans_of(a, b)
    t = tables.time_split_table(spans, index)
    rows = table(t)
    assert rows["own decode"][1][0] == pytest.approx(4.0)  # 200 tokens at 50 tok/s
    assert rows["own prefill"][1][0] == pytest.approx(2.0)  # 1,600 tokens at 800 tok/s
    assert rows["increment caused by others (waits, shared steps)"][1][0] == pytest.approx(14.0)
    assert "lower bound: decode 50.0 tok/s, prefill 800 tok/s" in t.note


def test_time_split_without_any_rate_to_use_says_so() -> None:
    spans, index = spans_of(rec("a", 0, 10, prompt_n=10, predicted_n=5),
                            rec("b", 1, 10, prompt_n=10, predicted_n=5))
    assert "no rates to compare against" in tables.time_split_table(spans, index).note


def test_decode_rate_inside_long_prefills_versus_the_rest() -> None:
    overlap = {
        "id": "x",
        "computed_tokens": 20000,
        "from_ms": 1000,
        "to_ms": 6000,
        "decode_events": 2,
        "decode_ms": 5000,
    }
    small = {
        "id": "y",
        "computed_tokens": 300,
        "from_ms": 7000,
        "to_ms": 7100,
        "decode_events": 1,
        "decode_ms": 100,
    }
    records = [
        rec("a", 0, 10.3, predicted_n=100, decode=10.0, overlaps=[overlap, small]),
        rec("b", 50, 2.3, predicted_n=40, decode=2.0),
    ]
    rows = table(record_tables.decode_rate_table(records, 15000))
    during = rows["while another slot prefilled >= 15,000 tokens"]
    assert during[0] == 1 and during[1][0] == pytest.approx(0.4)
    otherwise = rows["otherwise"]
    assert otherwise[0] == 2
    assert otherwise[1][2] == pytest.approx((98 + 40) / 7.0)  # pooled


def test_waits_grouped_by_the_lora_of_what_was_running() -> None:
    lora_a, lora_b = [{"id": 0, "scale": 1.0}], [{"id": 0, "scale": 0.0}]
    records = [
        rec("run", 0, 100, lora_out=lora_a),
        rec("other", 1, 10, wait=5, lora_out=lora_b, inflight_at_start=["run"]),
        rec("same", 2, 10, wait=2, lora_out=lora_a, inflight_at_start=["run"]),
        rec("none", 500, 10, wait=1.5, lora_out=lora_a),
        rec("short", 600, 10, wait=0.5, lora_out=lora_a),
    ]
    spans, index = spans_of(*records)
    rows = table(tables.waits_table(spans, index, Thresholds()))
    assert rows["requests with other LoRA settings"] == (1, (5.0, 5.0))
    assert rows["requests with the same LoRA settings"] == (1, (2.0, 2.0))
    assert rows["nothing"] == (1, (1.5, 1.5))
    # a wait for a slot counts under whatever ran: the sum tells set-ups apart whatever the LoRA
    assert rows["in all"] == (3, (8.5, 5.0))


def test_ttft_of_short_turns_split_by_contention() -> None:
    records = [
        rec("alone", 0, 5, wait=0.1, prefill=0.4),
        rec("big", 100, 30, wait=0.0, prefill=20, prompt_n=20000),
        rec("hit", 101, 20, wait=0.0, prefill=9.0),  # first token inside big's prefill
        rec("x", 200, 10, wait=0.0, prefill=0.5),
        rec("y", 201, 5, wait=0.0, prefill=2.0),  # overlaps x, which prefills 200.0-200.5
    ]
    spans, index = spans_of(*records)
    rows = table(tables.ttft_table(spans, index, Thresholds()))
    assert rows["nothing else running"] == (2, (0.5, pytest.approx(0.5), 0.5))
    assert rows["overlapping other requests"][0] == 1
    assert rows["overlapping a prefill of >= 5,000 tokens"] == (1, (9.0, 9.0, 9.0))


def test_sources_of_long_prefills() -> None:
    records = [
        rec("a1", 0, 30, prompt_n=20000, client="ann"),  # first turn of ann
        rec("a2", 100, 5, client="ann", purpose="summary"),
        rec("a3", 200, 30, prompt_n=15000, client="ann"),  # right after the summary
        rec("a4", 300, 5, prompt_n=6000, client="ann", purpose="translate"),
        rec("a5", 400, 5, prompt_n=7000, client="ann", purpose="translate"),
    ]
    spans, _ = spans_of(*records)
    rows = table(tables.sources_table(spans, Thresholds()))
    assert rows["first turn of a client (in the log, or after >= 30 min)"] == (1, (20000.0, 20000))
    assert rows["turn right after a 'summary' request of the same client"][0] == 1
    assert rows["purpose 'translate'"] == (2, (13000.0, 6500))


def test_requests_policy_and_estimate_tables() -> None:
    records = [
        rec("a", 0, 1, est_new_tokens=110, prompt_n=100, lora_rewritten=True),
        rec("b", 5, 1, est_new_tokens=100, prompt_n=40, fed_tokens=60, prefill_plan="chunked",
            pieces=3, held_ms=1500.0),
        rec("c", 9, 1, outcome="client_gone"),
    ]
    rows = table(record_tables.requests_table(records))
    assert rows["LoRA rewritten"] == (1, ())
    assert rows["outcome client_gone"] == (1, ())
    assert rows["requests"] == (3, ())
    policy = record_tables.policy_table(records)
    plans = table(policy)
    assert plans["fed in pieces (chunk)"] == (1, (pytest.approx(100 / 3), 1.5, 1.5))
    assert plans["forwarded at once"] == (2, (pytest.approx(200 / 3), None, None))
    assert plans["held, then forwarded (defer)"] == (0, (0.0, None, None))
    assert policy.note == "chunk: 3 pieces fed ahead, 60 prompt tokens computed in them"
    est = table(record_tables.estimate_table(records))["estimate - actual new tokens"]
    assert est[0] == 2 and est[1][0] == 5.0 and est[1][3] == 100.0


# ---- the chunk and defer policies' records --------------------------------------------------


def chunked(id: str, at: float, total: float, **extra: Any) -> dict[str, Any]:
    """A cold 3,300-token turn fed in 12 pieces of 256 tokens: the real request computed 52."""
    fields: dict[str, Any] = {
        "prompt_n": 52,
        "cache_n": 3248,
        "fed_tokens": 3072,
        "prefill_plan": "chunked",
        "pieces": 12,
        "held_ms": 4000.0,
        "est_new_tokens": 3150,
        "policy_note": "rest fits one piece after 12 pieces (3072 tokens fed)",
    }
    return rec(id, at, total, **(fields | extra))


def test_a_chunked_turn_counts_its_pieces_as_new_tokens() -> None:
    record = chunked("cold", 0, 10, wait=4.0, prefill=0.2)
    span = record_to_span(record)
    assert span.new_n == 3124 and span.cached_n == 176
    assert ("fed_tokens", "3072") in span.info and ("pieces", "12") in span.info
    # An old log has no fed_tokens: prompt_n alone.
    old = {k: v for k, v in record.items() if k != "fed_tokens"}
    assert record_to_span(old).new_n == 52


def test_turns_a_chunked_cold_turn_is_big_and_no_cache_hit() -> None:
    spans, _ = spans_of(
        chunked("cold", 0, 10),
        rec("hit", 100, 2, prompt_n=10, cache_n=3290),
    )
    rows = table(tables.turns_table(spans, Thresholds(big_new=1000)))
    assert rows["of which >= 95% cached"] == (1, (2.0, 2.0, 2.0))
    assert rows["of which >= 1,000 new tokens"] == (1, (10.0, 10.0, 10.0))


def test_ttft_short_turns_leave_out_a_chunked_cold_turn() -> None:
    records = [
        chunked("cold", 0, 10, wait=4.0, prefill=0.1),  # TTFT 4.1 s, 52 tokens computed by itself
        # arrives while cold's pieces are fed (before its own prefill_start at 4.0 s)
        rec("short", 1, 3, wait=0.0, prefill=0.5),
        rec("alone", 100, 2, wait=0.0, prefill=0.3),
    ]
    spans, index = spans_of(*records)
    rows = table(tables.ttft_table(spans, index, Thresholds(big_new=1000)))
    assert sum(n for n, _ in rows.values()) == 2
    assert rows["overlapping a prefill of >= 1,000 tokens"] == (1, (0.5, 0.5, 0.5))
    assert rows["nothing else running"][0] == 1


def test_sources_include_a_chunked_cold_turn() -> None:
    spans, _ = spans_of(chunked("cold", 0, 10, client="ann"), rec("next", 100, 2, client="ann"))
    rows = table(tables.sources_table(spans, Thresholds(big_new=1000)))
    assert rows == {"first turn of a client (in the log, or after >= 30 min)": (1, (3124.0, 3124))}


def test_estimate_compares_with_the_tokens_of_the_pieces_too() -> None:
    records = [chunked("cold", 0, 10), chunked("old", 20, 10, fed_tokens=None, est_new_tokens=55)]
    est = table(record_tables.estimate_table(records))["estimate - actual new tokens"]
    # cold: 3150 - (52 + 3072) = 26; old log without fed_tokens: 55 - 52 = 3
    assert est == (2, (14.5, pytest.approx(24.85), 26.0, 100.0))


def test_time_split_counts_the_pieces_as_own_prefill() -> None:
    alone = rec("a", 0, 3.0, wait=0.0, prefill=1.0, prompt_n=800, predicted_n=100, decode=2.0)
    cold = chunked("cold", 100, 10.0, wait=4.0, prefill=0.1, predicted_n=100, decode=5.9,
                   inflight_at_start=["x"])
    spans, index = spans_of(alone, cold, rec("x", 99, 20))
    rows = table(tables.time_split_table(spans[:2], index))
    assert rows["own prefill"][1][0] == pytest.approx((800 + 3124) / 800)


def test_decode_rate_while_a_chunked_peer_was_fed() -> None:
    # overlaps[].new_tokens counts a chunked peer's pieces: the stream's rate shows up as "during".
    ov = {"id": "cold", "new_tokens": 3124, "from_ms": 1000, "to_ms": 5000,
          "decode_events": 20, "decode_ms": 4000}
    records = [rec("s", 0, 10.3, predicted_n=100, decode=10.0, overlaps=[ov])]
    rows = table(record_tables.decode_rate_table(records, 1000))
    assert rows["while another slot prefilled >= 1,000 tokens"][1][0] == pytest.approx(5.0)


def test_policy_notes_by_kind_only_failures_count_as_failed_open() -> None:
    notes = [
        "rest fits one piece after 12 pieces (3072 tokens fed)",
        "nobody generating after 2 pieces (512 tokens fed)",
        "cold, nobody generating",
        "cold, rest fits one piece",
        "held until others finished",
        "held prefill.max_hold_s",
        "prefill.mode off (reload) after 1 pieces (256 tokens fed)",
        "not estimated, forwarded as it came: tokenizer unavailable",
        "piece failed, forwarded as it came: upstream 500",
        "piece failed, forwarded as it came: internal error: KeyError: 'x'",
        "something new",
    ]
    records = [rec(f"r{i}", i, 1, policy_note=n) for i, n in enumerate(notes)]
    records += [rec("quiet", 50, 1), rec("null", 51, 1, policy_note=None)]
    rows = table(record_tables.notes_table(records))
    assert {label: n for label, (n, _) in rows.items()} == {
        "no note (not cold, policy off, or not generating)": 2,
        "released after pieces: the rest fits one piece": 1,
        "released after pieces: nobody generating": 1,
        "cold, admitted whole: nobody generating": 1,
        "cold, admitted whole: fits one piece": 1,
        "held until others finished (defer)": 1,
        "held until prefill.max_hold_s (defer)": 1,
        "released by a reload (prefill.mode off)": 1,
        "other note": 1,
        "failed open: not estimated": 1,
        "failed open: piece failed": 1,
        "failed open: internal error": 1,
        "failed open, all kinds (the policy did not apply)": 3,
    }


def test_policy_notes_show_failures_as_zero_when_there_are_none() -> None:
    rows = table(record_tables.notes_table([chunked("cold", 0, 10), rec("b", 5, 1)]))
    assert rows["failed open: not estimated"] == (0, ())
    assert rows["failed open, all kinds (the policy did not apply)"] == (0, ())
    assert rows["released after pieces: the rest fits one piece"] == (1, ())
    assert "held until others finished (defer)" not in rows


def test_policy_table_held_times_for_defer() -> None:
    records = [
        rec("h1", 0, 5, prefill_plan="held", held_ms=2000.0, policy_note="held until others finished"),
        rec("h2", 10, 5, prefill_plan="held", held_ms=4000.0, policy_note="held prefill.max_hold_s"),
        rec("n", 20, 5),
        rec("odd", 30, 5, prefill_plan="queued"),
    ]
    rows = table(record_tables.policy_table(records))
    assert rows["held, then forwarded (defer)"] == (2, (50.0, 3.0, 4.0))
    assert rows["fed in pieces (chunk)"] == (0, (0.0, None, None))
    assert rows["plan queued"][0] == 1
    assert "of them, waiting for a free slot" not in rows  # a log without slot waits


def test_policy_table_says_how_many_waited_for_a_free_slot() -> None:
    records = [
        rec("a", 0, 5, prefill_plan="held", held_ms=3000.0, slot_wait_ms=3000.0),
        rec("b", 10, 5, prefill_plan="chunked", held_ms=9000.0, slot_wait_ms=1000.0),
        rec("c", 20, 5, prefill_plan="held", held_ms=2000.0, slot_wait_ms=0.0),
        rec("n", 30, 5),
    ]
    rows = table(record_tables.policy_table(records))
    assert rows["of them, waiting for a free slot"] == (2, (50.0, 2.0, 3.0))


def write_log(path: Path, records: list[dict[str, Any]], extra: str = "") -> Path:
    lines = [json.dumps({k: v for k, v in r.items() if k != "_t0"}) for r in records]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def test_loader_counts_lines_that_are_not_records(tmp_path: Path) -> None:
    log = load_timing_log(str(write_log(tmp_path / "t.jsonl", [rec("a", 0, 1)], "oops\n[1]\n")))
    assert len(log.records) == 1 and log.bad_lines == (2, 3)


def test_loader_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read timing log"):
        load_timing_log(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.txt").write_text("hello\nworld\n")
    with pytest.raises(InputError, match="no timing records"):
        load_timing_log(str(tmp_path / "x.txt"))


@pytest.fixture
def log_file(tmp_path: Path) -> Path:
    records = [rec(f"r{i}", i * 60.0, 5 + i, client="ann") for i in range(6)]
    records.append(rec("late", 3600 * 5, 3, client="bob"))
    return write_log(tmp_path / "timing.jsonl", records, "not json\n")


def test_cli_report_text_mentions_every_table_and_the_bad_line(
    log_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(log_file)]) == 0
    out = capsys.readouterr().out
    for title in (
        "Turns: total time",
        "Where the time went",
        "Decode rate",
        "Waits of 1 s",
        "Streams' stalls of 1 s",
        "Time to first token",
        "Sources of prefills",
        "Estimate accuracy",
    ):
        assert title in out
    assert "1 of 8 lines are not timing records" in out


def test_cli_report_json_and_since(log_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "report",
                str(log_file),
                "--since",
                "2025-11-05T03:21:30Z",
                "--until",
                "2025-11-05T04:00",
                "--format",
                "json",
            ]
        )
        == 0
    )
    body = json.loads(capsys.readouterr().out)
    turns = next(t for t in body["tables"] if t["key"] == "turns")
    assert turns["rows"][0]["n"] == 4  # r2..r5


def test_cli_compare_ranges_show_the_count_in_every_cell(
    log_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "report",
            str(log_file),
            "--format",
            "markdown",
            "--compare",
            "2025-11-05T03:20..2025-11-05T03:23",
            "2025-11-05T03:23..",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("| all turns"))
    assert "(3)" in line and "(4)" in line


def test_cli_compare_two_files(log_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--compare", str(log_file), str(log_file), "--format", "html"]) == 0
    assert "<table>" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "/nonexistent.jsonl"], "cannot read timing log"),
        (["report", "LOG", "--since", "yesterday"], "--since: 'yesterday' is not a time"),
        (["report", "LOG", "--compare", "a", "b"], "neither a file nor a time range"),
        (["report", "LOG", "--timeline", "x.svg"], "must end in .html or .png"),
    ],
)
def test_cli_bad_input_is_one_line(
    argv: list[str], message: str, log_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(log_file) if a == "LOG" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_compare_pairs_rows_in_order_and_a_missing_row_has_no_samples() -> None:
    from proxy.report.cells import compact, paired_rows

    off = record_tables.notes_table([rec("a", 0, 1)])
    chunk = record_tables.notes_table([chunked("cold", 0, 10), rec("b", 5, 1)])
    labels = [label for label, _, _ in paired_rows(off, chunk)]
    assert labels[:2] == ["no note (not cold, policy off, or not generating)",
                          "released after pieces: the rest fits one piece"]
    assert labels[-1] == "failed open, all kinds (the policy did not apply)"
    assert compact(off, None) == "0"
    turns = tables.turns_table([], Thresholds())
    assert compact(turns, None) == "- / - / - (0)"


@pytest.mark.parametrize("fmt", ["text", "markdown", "html", "json"])
def test_compare_of_off_and_chunk_logs_in_every_format(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ov = {"id": "cold", "new_tokens": 3124, "from_ms": 0, "to_ms": 4000,
          "decode_events": 8, "decode_ms": 4000}
    off = write_log(tmp_path / "off.jsonl", [
        rec("cold", 0, 10, wait=0.0, prefill=4.0, prompt_n=3300, client="ann"),
        rec("s", 1, 10, wait=0.0, prefill=0.1, overlaps=[ov]),
    ])
    chunk = write_log(tmp_path / "chunk.jsonl", [
        chunked("cold", 0, 10, wait=4.0, prefill=0.1, client="ann"),
        rec("s", 1, 10, wait=0.0, prefill=0.1, overlaps=[ov], est_new_tokens=100),
    ])
    argv = ["report", "--compare", str(off), str(chunk), "--long-prefill", "1000",
            "--big-new", "1000", "--format", fmt]
    assert main(argv) == 0
    out = capsys.readouterr().out
    if fmt == "json":
        reports = json.loads(out)["reports"]
        est = next(t for t in reports[1]["tables"] if t["key"] == "estimate")
        assert est["rows"][0]["values"][0] == 13.0  # median of 26 and 0
        notes = next(t for t in reports[1]["tables"] if t["key"] == "policy_notes")
        failed = {r["label"]: r["n"] for r in notes["rows"]}
        assert failed["failed open, all kinds (the policy did not apply)"] == 0
        return
    assert "released after pieces: the rest fits one piece" in out
    if fmt == "markdown":  # a header's "|error|" must not split its cell
        assert "| median error / p95 \\|error\\| / max \\|error\\| / within 10% (n) |" in out
    assert "fed in pieces (chunk)" in out
    assert "chunk: 12 pieces fed ahead, 3,072 prompt tokens computed in them" in out
    assert "policy failed open" not in out and "held (count)" not in out
    # the chunked cold turn is a source of a long prefill in both logs, and no short turn
    line = next(x for x in out.splitlines() if "first turn of a client" in x)
    assert "(1)" in line and line.count("(1)") == 2
    assert "3,124" in line and "3,300" in line


def test_waits_leave_out_a_turn_fed_in_pieces() -> None:
    records = [rec("run", 0, 100), chunked("cold", 1, 10, wait=4.0, inflight_at_start=["run"])]
    spans, index = spans_of(*records)
    t = tables.waits_table(spans, index, Thresholds())
    assert table(t)["in all"][0] == 0
    assert t.note.startswith("left out: 1 request(s) fed in pieces")


# ---- streams' stalls --------------------------------------------------------------------


def stream(id: str, at: float, total: float, gap_at: float, gap: float, **extra: Any) -> dict[str, Any]:
    """A stream whose longest gap between token events began `gap_at` s after its arrival."""
    return rec(id, at, total, wait=0.0, prefill=0.5, gap_max_ms=gap * 1000,
               gap_max_at_ms=gap_at * 1000, **extra)


def own_work(id: str, at: float, total: float, kind: str, **extra: Any) -> dict[str, Any]:
    """A record of slotwise's own (a warm-up, a save or a restore): no prefill, no token."""
    record = rec(id, at, total, kind=kind, **extra)
    del record["timings"], record["prefill_wait_ms"], record["ttft_ms"]
    return record


def stalls_log() -> list[dict[str, Any]]:
    return [
        # ann froze for 3 s of big's 20 s prefill; peer was decoding then, computing nothing
        rec("big", 100, 40, wait=0.0, prefill=20, prompt_n=20_000),
        rec("peer", 50, 90, wait=0.0, prefill=1.0),
        stream("s1", 90, 60, gap_at=15, gap=3.0, client="ann"),
        # s2 froze while cold's pieces were computed (cold arrived at 300, first token at 308.1)
        chunked("cold", 300, 20, wait=8.0, prefill=0.1),
        stream("s2", 295, 30, gap_at=7, gap=2.0),
        own_work("w", 500, 10, "warm", fed_tokens=4000, pieces=16),
        stream("s3", 495, 30, gap_at=8, gap=1.5, client="cho"),
        own_work("keep-restore", 700, 2, "kv_restore", kv_tokens=24_000),
        stream("s4", 690, 30, gap_at=10.5, gap=1.2),
        stream("s5", 900, 30, gap_at=2, gap=1.1),  # nothing else ran
        stream("s6", 95, 30, gap_at=10, gap=0.8),  # inside big's prefill, under the threshold
        {k: v for k, v in stream("s7", 1000, 30, gap_at=5, gap=2.5).items() if k != "gap_max_at_ms"},
    ]


def test_stalls_grouped_by_what_was_computed_during_the_longest_gap() -> None:
    spans, index = spans_of(*stalls_log())
    t = stalls_table(spans, index, Thresholds())
    assert t.title == "Streams' stalls of 1 s or more, by what was computed meanwhile"
    assert table(t) == {
        "another request's prompt, sent whole": (1, (3.0, 3.0)),
        "a prompt fed in pieces (chunk)": (1, (2.0, 2.0)),
        "a warm-up": (1, (1.5, 1.5)),
        "a kept KV save or restore": (1, (1.2, 1.2)),
        "nothing seen": (1, (1.1, 1.1)),
        "in all": (5, (pytest.approx(8.8), 3.0)),
    }
    assert t.note == (
        "longest: ann (s1) 3.0 s while big was computed, s2 2.0 s while cold was computed, "
        "cho (s3) 1.5 s while w was computed; left out: 1 stream(s) with a gap of 1 s or more whose "
        "record has no gap_max_at_ms (written by an older slotwise)")


def test_stalls_show_every_row_when_no_stream_stalled() -> None:
    spans, index = spans_of(rec("a", 0, 10), stream("s", 5, 10, gap_at=2, gap=0.2))
    t = stalls_table(spans, index, Thresholds())
    assert [(r.label, r.n) for r in t.rows] == [
        ("another request's prompt, sent whole", 0), ("a prompt fed in pieces (chunk)", 0),
        ("a warm-up", 0), ("a kept KV save or restore", 0), ("nothing seen", 0), ("in all", 0)]
    assert t.note == ""


def test_the_stall_is_named_by_what_computed_for_most_of_it() -> None:
    # s froze from 10 to 14 s: a's prefill covered 10-11, b's 11-14 (its first piece at 11)
    records = [rec("a", 9, 5, wait=0.0, prefill=2.0), chunked("b", 11, 10, wait=3.0, prefill=0.1),
               stream("s", 0, 20, gap_at=10, gap=4.0)]
    spans, index = spans_of(*records)
    t = stalls_table(spans, index, Thresholds())
    assert table(t)["a prompt fed in pieces (chunk)"][0] == 1
    assert t.note == "longest: s 4.0 s while b was computed"


def test_cli_min_stall_lists_shorter_stalls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_log(tmp_path / "stalls.jsonl", stalls_log())
    assert main(["report", "--min-stall", "0.5", str(path)]) == 0
    out = capsys.readouterr().out
    title = "Streams' stalls of 0.5 s or more, by what was computed meanwhile"
    assert title in out
    whole = next(x for x in out[out.index(title):].splitlines() if "sent whole" in x)
    assert whole.split()[-5:] == ["2", "3.8", "s", "3.0", "s"]  # s1's 3 s and s6's 0.8 s


def test_a_log_without_fed_tokens_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = {k: v for k, v in chunked("cold", 0, 10).items() if k != "fed_tokens"}
    path = write_log(tmp_path / "old.jsonl", [old, rec("b", 5, 1)])
    assert main(["report", str(path)]) == 0
    assert "1 record(s) fed in pieces have no fed_tokens" in capsys.readouterr().out


def test_compare_says_a_note_both_tables_share_once() -> None:
    from proxy.report.model import Report
    from proxy.report.render import grids

    t = tables.time_split_table(*spans_of(rec("a", 0, 10), rec("b", 1, 10)))
    (grid,) = grids([Report("x", (t,)), Report("y", (t,))], ["off", "chunk"])
    assert grid[1] == ["seconds / share (n)", "off", "chunk"]
    assert grid[3] == t.note


def test_ttft_a_chunked_peer_counts_from_its_first_piece() -> None:
    from proxy.report.records import first_pieces

    # cold arrives at 0; its first piece begins at 3 s, as s2's overlap (from 1 s after s2's
    # arrival at 2 s) tells. s1's first token (at 1.5 s) came before: not inside a long prefill.
    ov = {"id": "cold", "new_tokens": 3124, "from_ms": 1000, "to_ms": 4000,
          "decode_events": 3, "decode_ms": 3000}
    records = [
        chunked("cold", 0, 20, wait=8.0, prefill=0.1),
        rec("s1", 1, 5, wait=0.0, prefill=0.5),
        rec("s2", 2, 6, wait=0.0, prefill=1.5, overlaps=[ov]),  # first token at 3.5 s
    ]
    pieces = first_pieces(records)
    assert pieces == {"cold": pytest.approx(T0 + 3.0)}
    spans = [record_to_span(r, pieces) for r in records]
    rows = table(tables.ttft_table(spans, SpanIndex(spans), Thresholds(big_new=1000)))
    assert rows["overlapping other requests"][0] == 1
    assert rows["overlapping a prefill of >= 1,000 tokens"][0] == 1


def test_an_anthropic_turn_without_timings_counts_from_its_usage() -> None:
    """/v1/messages answers carry no `timings`; the record's computed_tokens and prompt_tokens
    (from its usage) stand in, so such turns are split by cache hit like the others."""
    warm = rec("m", 0, 10, kind="messages", prompt_tokens=1000, computed_tokens=10)
    cold = rec("n", 100, 20, kind="messages", prompt_tokens=6000, computed_tokens=6000)
    for record in (warm, cold):
        del record["timings"]
    assert is_turn(warm) and new_tokens(cold) == 6000
    spans, _ = spans_of(warm, cold)
    assert [(s.prompt_n, s.cache_n) for s in spans] == [(10, 990), (6000, 0)]
    rows = table(tables.turns_table(spans, Thresholds()))
    assert rows["of which >= 95% cached"][0] == 1
    assert rows["of which >= 5,000 new tokens"][0] == 1


def test_a_short_turn_during_a_warm_ups_pieces_overlaps_a_long_prefill() -> None:
    """A warm-up's record has no timings of its own: what it computed is its `fed_tokens`, so a
    turn waiting while it ran counts as overlapping a long prefill, as behind a chunked turn."""
    warm = rec("w", 0, 10, kind="warm", fed_tokens=4000, pieces=16, wait=0.0)
    del warm["timings"], warm["prefill_wait_ms"], warm["ttft_ms"]
    short = rec("s", 2, 3, wait=0.5, prefill=0.5)
    spans, index = spans_of(warm, short)
    assert spans[0].new_n == 4000
    rows = table(tables.ttft_table(spans, index, Thresholds(big_new=1000)))
    assert rows["overlapping a prefill of >= 1,000 tokens"][0] == 1


def test_time_cells_read_in_ms_under_a_second_and_in_s_from_one() -> None:
    from proxy.report.cells import fmt

    assert [fmt(v, "s") for v in (0.0, 0.0042, 0.34, 0.9996, 1.0, 12.34, 250.0)] == [
        "0.0 ms", "4.2 ms", "340 ms", "1.0 s", "1.0 s", "12.3 s", "250 s"]
    assert [fmt(v, "ms") for v in (25.3, 340.0, 2400.0)] == ["25 ms", "340 ms", "2.4 s"]


def test_cli_report_shows_sub_second_turns_in_ms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [rec(f"r{i}", i * 60.0, 0.6, wait=0.0, prefill=0.34) for i in range(5)]
    assert main(["report", str(write_log(tmp_path / "short.jsonl", records))]) == 0
    out = capsys.readouterr().out
    ttft = next(x for x in out.splitlines() if x.strip().startswith("nothing else running"))
    assert ttft.count("340 ms") == 3  # median, p90, max
    turns = next(x for x in out.splitlines() if x.strip().startswith("all turns"))
    assert "600 ms" in turns
    p95 = next(x for x in out.splitlines() if x.strip().startswith("time to first token p95"))
    assert p95.rstrip().endswith("340 ms")  # the overview's unlike figures carry a unit per row
    assert " 0.0 s" not in out and "0.3 s" not in out
