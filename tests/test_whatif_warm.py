"""Warm-ups in `slotwise whatif`: the warm-up calls a log shows are asked for again, after the
request they followed, and slotwise's own warm-up queue runs them inside the model: the turn they
were for finds its prefix computed and is credited with it, the streams keep their pace, and with
`warm.enabled=false` the calls are refused and the turn computes it all. A warm-up the log shows
restored a kept file restores it in the model too (keep_kv)."""

from __future__ import annotations

from typing import Any

from proxy.report.records import parse_time
from proxy.whatif.kept import RESTORE_SUFFIX
from proxy.whatif.requests import build_workload
from proxy.whatif.synth import loaded, record
from proxy.whatif.warmjobs import warm_jobs
from tests.test_whatif import played

SUMMARY_END_S = 1.0 + 3.0


def warm_call(wid: str, t: float, client: str, prefix: int) -> dict[str, Any]:
    """A warm-up's record as the warmer writes it (its prefix, all of it to compute)."""
    return {**record(wid, t, client, prefix, 0, 0), "kind": "warm", "stream": False,
            "endpoint": "/slotwise/warm/v1/chat/completions", "status": 202, "timings": None,
            "computed_tokens": None, "events": None, "est_prompt_tokens": prefix,
            "est_new_tokens": prefix, "fed_tokens": prefix, "pieces": 8,
            "prefill_plan": "chunked", "total_ms": 4000.0}


def post_summary_day(prefix: int = 2500, think_s: float = 12.0) -> list[dict[str, Any]]:
    """Client `a` streams; client `b` folds its history into a summary, its chat app asks for a
    warm-up of the new prompt as the summary ends, and `think_s` later `b` sends the next turn,
    which found the warm-up's `prefix` tokens computed."""
    stream = record("s", 0.0, "a", 300, 0, 3000)
    summary = {**record("sum", 1.0, "b", 6000, 5800, 150, purpose="summary"), "total_ms": 3000.0}
    turn = {**record("b1", SUMMARY_END_S + think_s, "b", prefix + 120, prefix, 60),
            "warmed_tokens": prefix, "warm_ids": ["w"]}
    return loaded([stream, summary, warm_call("w", SUMMARY_END_S + 0.2, "b", prefix), turn])


def by_id(*sets: str, day: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {r.id: r for r in played(day or post_summary_day(), "prefill.mode=chunk", *sets)
            .outcome.records}


class TestWorkload:
    def test_a_warm_ups_prefix_is_the_first_tokens_of_the_turn_it_was_for(self) -> None:
        work = build_workload(post_summary_day())
        plan = warm_jobs(work.warm_records, work.jobs)
        ((warm,), turn) = plan.jobs, next(j for j in work.jobs if j.id == "b1")
        assert warm.prefix.length == 2500 and warm.prefix == turn.prompt.prefix(2500)
        # the turn's recorded cache leaves out what the warm-up computed for it
        assert turn.recorded_cache == 0
        assert (warm.after, round(warm.think_s, 3)) == ("sum", 0.2)

    def test_a_warm_up_with_no_size_or_no_later_turn_is_left_out_and_said(self) -> None:
        day = loaded([record("s", 0.0, "a", 300, 0, 50), warm_call("lost", 1.0, "z", 900)])
        work = build_workload(day)
        assert [r["id"] for r in warm_jobs(work.warm_records, work.jobs).unplaced] == ["lost"]
        prediction = played(day)
        assert any("warm-ups: 1 copied as they were" in n for n in prediction.notes)
        # its one record is in the what-if's log all the same
        assert sum(b'"id":"lost"' in line for line in prediction.lines) == 1


class TestReplay:
    def test_the_turn_finds_its_prefix_warmed_and_is_credited(self) -> None:
        out = by_id()
        warm, turn = out["w"], out["b1"]
        assert warm.kind == "warm" and warm.outcome == "done" and warm.status == 202
        assert warm.fed_tokens >= 2400 and warm.pieces >= 2
        assert turn.warmed_tokens >= 2400 and turn.warm_ids == ("w",)
        assert (turn.computed_tokens or 0) <= 220
        # asked for as the summary ended in the what-if, not at its logged time
        summary_end = parse_time(str(out["sum"].start)) + (out["sum"].total_ms or 0) / 1000.0
        assert abs(parse_time(str(warm.start)) - (summary_end + 0.2)) < 0.01

    def test_with_warm_ups_off_the_call_is_refused_and_the_turn_computes_it(self) -> None:
        warmed, off = by_id(), by_id("warm.enabled=false")
        assert off["w"].status == 503 and off["w"].outcome == "rejected"
        assert off["b1"].warmed_tokens == 0
        assert off["b1"].fed_tokens + (off["b1"].computed_tokens or 0) >= 2600
        assert (warmed["b1"].ttft_ms or 0) * 2 < (off["b1"].ttft_ms or 0)

    def test_the_stream_keeps_its_pace_while_the_warm_up_computes(self) -> None:
        out = by_id()
        # pieces sized to max_stall_ms (160): the stream's longest gap stays about one piece
        assert (out["s"].gap_max_ms or 0) < 2 * 160 + 100

    def test_a_turn_that_comes_before_its_warm_up_is_done_ends_it_and_gets_what_it_did(self) -> None:
        out = by_id(day=post_summary_day(prefix=6000, think_s=2.0))
        warm, turn = out["w"], out["b1"]
        assert warm.outcome == "superseded" and 0 < warm.fed_tokens < 6000
        assert turn.warmed_tokens == warm.fed_tokens and turn.warm_ids == ("w",)
        # the rest was computed by the turn itself, not lost
        assert turn.warmed_tokens + (turn.fed_tokens or 0) + (turn.computed_tokens or 0) >= 6120


def returning_with_warm_up(turn_at: float = 6.0,
                           between: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Client `a` streams; client `b` comes back to a 6,000-token history saved before the log
    (llama-server restarted since, nothing cached): its chat app asks for a warm-up, which
    restores the kept file (its record, as the keeper writes it: the 5,999 tokens the file
    covered) and has nothing left to compute (so no turn is credited with it); at `turn_at` `b`
    sends the turn, which finds those tokens cached. `between`: other requests of the day."""
    warm = {**warm_call("w", 1.0, "b", 6000), "fed_tokens": 0, "pieces": 0,
            "prefill_plan": "none", "total_ms": 400.0, "restored_tokens": 5999}
    call = {**record(f"w{RESTORE_SUFFIX}", 1.0, "b", 0, 0, 0), "kind": "kv_restore",
            "endpoint": "/slots/1?action=restore", "stream": False, "total_ms": 300.0,
            "restored_tokens": 5999, "kv_tokens": 6000, "kv_bytes": 6000 * 25_000,
            "kv_file": "slotwise-cc.kv", "timings": None}
    return loaded([record("s", 0.0, "a", 300, 0, 400), warm, call, *(between or []),
                   record("b1", turn_at, "b", 6100, 5999, 50)])


class TestKeptFile:
    def test_the_turn_after_a_warm_up_that_restored_counts_those_tokens_restored(self) -> None:
        work = build_workload(returning_with_warm_up())
        turn = next(j for j in work.jobs if j.id == "b1")
        # not a sequence cached before the log: the file's, which the turn may restore itself
        assert (turn.kept, turn.recorded_cache) == (5999, 0) and not work.before_log
        assert work.file_of("b1") is work.files["w"] and work.restored_by_warm_up == {"w": "b1"}
        (warm,) = warm_jobs(work.warm_records, work.jobs, restored=work.restored_by_warm_up).jobs
        assert warm.kept == 5999 and warm.prefix == turn.prompt.prefix(6000)

    def test_another_request_of_the_client_before_the_turn_gets_nothing_of_the_file(self) -> None:
        """`b` asks something else in between (a short question, a little cached): the file is
        its turn's, which found it, not that request's."""
        other = record("b0", 3.0, "b", 900, 600, 20)
        work = build_workload(returning_with_warm_up(between=[other]))
        b0, b1 = (next(j for j in work.jobs if j.id == rid) for rid in ("b0", "b1"))
        assert b0.kept == 0 and work.file_of("b0") is None
        assert b1.kept == 5999 and work.restored_by_warm_up == {"w": "b1"}

    def test_the_warm_up_restores_the_file_and_the_turn_computes_only_its_message(self) -> None:
        out = by_id(day=returning_with_warm_up())
        warm, turn = out["w"], out["b1"]
        assert warm.outcome == "done" and warm.restored_tokens == 5999 and warm.fed_tokens == 0
        restore = out[f"w{RESTORE_SUFFIX}"]
        assert restore.kind == "kv_restore" and restore.total_ms == 300.0
        assert turn.restored_tokens == 0 and (turn.computed_tokens or 0) <= 101
        assert parse_time(str(restore.start)) < parse_time(str(turn.start))

    def test_a_turn_that_comes_during_the_restore_waits_for_it_and_finds_the_file(self) -> None:
        out = by_id(day=returning_with_warm_up(turn_at=1.1))
        warm, turn, restore = out["w"], out["b1"], out[f"w{RESTORE_SUFFIX}"]
        assert warm.outcome == "superseded" and warm.restored_tokens == 5999
        assert turn.restored_tokens == 0 and (turn.computed_tokens or 0) <= 101
        restore_end = parse_time(str(restore.start)) + (restore.total_ms or 0) / 1000.0
        assert parse_time(str(turn.start)) < restore_end
        assert parse_time(str(turn.start)) + (turn.ttft_ms or 0) / 1000.0 > restore_end

    def test_a_warm_up_that_finds_every_slot_taken_restores_once_one_comes_free(self) -> None:
        """Three more streams take the other slots (`-np 4`): the warm-up waits (the queue's rule
        5) and restores into the slot the shortest reply leaves."""
        others = [record("c1", 0.0, "c", 300, 0, 60), record("d1", 0.0, "d", 300, 0, 3000),
                  record("e1", 0.0, "e", 300, 0, 3000)]
        out = by_id(day=returning_with_warm_up(between=others))
        restore, c1 = out[f"w{RESTORE_SUFFIX}"], out["c1"]
        c1_end = parse_time(str(c1.start)) + (c1.total_ms or 0) / 1000.0
        assert c1_end > parse_time(str(out["w"].start)) + 0.5  # every slot was taken meanwhile
        assert parse_time(str(restore.start)) >= c1_end - 0.05
        assert out["w"].restored_tokens == 5999 and (out["b1"].computed_tokens or 0) <= 101

    def test_with_warm_ups_off_the_turn_restores_it_and_with_keep_kv_off_it_is_computed(self) -> None:
        day = returning_with_warm_up()
        no_warm = by_id("warm.enabled=false", day=day)
        assert no_warm["w"].status == 503
        assert no_warm["b1"].restored_tokens == 5999
        assert no_warm[f"b1{RESTORE_SUFFIX}"].kind == "kv_restore"
        assert (no_warm["b1"].computed_tokens or 0) <= 101
        no_keep = by_id("keep_kv.enabled=false", day=day)
        assert f"w{RESTORE_SUFFIX}" not in no_keep and no_keep["w"].restored_tokens == 0
        # the history computed again, by the warm-up and the turn between them
        b1 = no_keep["b1"]
        assert no_keep["w"].fed_tokens + b1.fed_tokens + (b1.computed_tokens or 0) >= 6000
