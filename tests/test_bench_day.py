"""`slotwise bench day`: the plan of the day (who does what, at which scale, on which server), its
conversations, the client-side records that let `slotwise report`'s tables be built alike on every
path, the day's own figures, and tables that keep every figure within 80 columns."""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import re
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web
from rich.console import Console
from rich.table import Table

from proxy.bench import day_talk as talk
from proxy.bench.calls import Call, client_record, client_records
from proxy.bench.day import (
    DAY_SETUPS,
    DEFAULT_PATHS,
    OTHER_LORA,
    PATHS,
    Act,
    DayPlan,
    Step,
    chunk_tables,
    plan_day,
    server_args,
    slotwise_tables,
)
from proxy.bench.day_cli import _names, _scale, describe, run_day
from proxy.bench.day_records import (
    Alone,
    alone_body,
    cold_calls,
    day_figures,
    slot_wait,
)
from proxy.bench.day_tables import REPORT_KEYS, cell, day_grid, report_grid, report_tables
from proxy.bench.harness import StreamResult
from proxy.bench.output import print_table
from proxy.report.records import LoadedTimingLog, load_timing_log
from proxy.report.tables import Thresholds

WALL = 1_780_000_000.0


# -- the plan ------------------------------------------------------------------------------------

def test_five_users_over_the_day_and_a_background_translation() -> None:
    plan = plan_day()
    users = [u for u in plan.users if not u.background]
    assert [u.name for u in users] == ["ann", "bob", "cho", "dan", "eve"]
    assert [u.name for u in plan.users if u.background] == ["translator"]
    assert {st.act for st in plan.user("translator").steps} == {Act.TRANSLATE}


def test_two_users_return_with_histories_of_four_to_six_thousand_tokens() -> None:
    plan = plan_day()
    back = {u.name: u.yesterday_tokens for u in plan.users if u.yesterday_tokens}
    assert back == {"dan": 6000, "eve": 4000}
    for name in back:
        assert plan.user(name).steps[0].act is Act.RETURN
        assert plan.user(name).steps[0].not_before_s > 0


def test_a_summary_is_followed_by_the_apps_warm_up_then_the_turn_on_the_new_prompt() -> None:
    plan = plan_day()
    for name in ("ann", "bob"):
        acts = [st.act for st in plan.user(name).steps]
        at = acts.index(Act.SUMMARY)
        assert acts[at:at + 3] == [Act.SUMMARY, Act.WARM, Act.RESUME]
        warm = plan.user(name).steps[at + 1]
        assert warm.think_s == 0.0 and warm.reply_tokens == 0  # at once, no reply


def test_only_one_client_sends_other_lora_settings() -> None:
    assert [u.name for u in plan_day().users if u.lora is not None] == ["cho"]
    assert plan_day().user("cho").lora == OTHER_LORA


def test_chat_turns_stream_a_few_hundred_tokens() -> None:
    replies = [st.reply_tokens for u in plan_day().users if not u.background for st in u.steps
               if st.act in (Act.CHAT, Act.RETURN, Act.RESUME)]
    assert min(replies) >= 100 and max(replies) <= 300


def test_the_scale_multiplies_sizes_think_times_and_turns() -> None:
    full, half = plan_day(1.0), plan_day(0.5)
    assert half.user("dan").yesterday_tokens == full.user("dan").yesterday_tokens // 2
    assert half.user("ann").card_tokens == full.user("ann").card_tokens // 2
    assert half.user("eve").steps[0].not_before_s == full.user("eve").steps[0].not_before_s / 2
    assert len(half.user("cho").steps) == len(full.user("cho").steps) // 2
    assert half.long_tokens == full.long_tokens // 2


def test_a_tiny_scale_keeps_one_turn_of_each_kind_and_sixteen_tokens() -> None:
    tiny = plan_day(0.01)
    for user in tiny.users:
        assert user.steps
        assert all(st.reply_tokens >= 16 for st in user.steps if st.act is not Act.WARM)
    assert [st.act for st in tiny.user("ann").steps] == [
        Act.CHAT, Act.SUMMARY, Act.WARM, Act.RESUME, Act.CHAT]


def test_the_same_seed_plays_the_same_day_on_every_path() -> None:
    assert plan_day(seed=3) == plan_day(seed=3)
    assert plan_day(seed=3) != plan_day(seed=4)


def test_a_stalled_day_is_cut_after_a_limit_that_scales_with_it() -> None:
    assert plan_day().limit_s == 360.0 and plan_day(0.5).limit_s == 180.0
    assert plan_day(0.05).limit_s == 60.0  # a tiny day's requests cost what they cost
    assert plan_day().requests() == sum(
        1 for u in plan_day().users for st in u.steps if st.act is not Act.WARM)


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_a_scale_of_zero_or_less_is_refused(scale: float) -> None:
    with pytest.raises(ValueError, match="scale must be above 0"):
        plan_day(scale)


def test_each_slot_has_room_for_the_largest_conversation_of_the_day() -> None:
    plan = plan_day()
    largest = plan.user("dan").yesterday_tokens + 4 * (300 + 40)
    assert plan.ctx_per_slot >= largest and plan.ctx_per_slot % 1024 == 0


def test_the_report_layout_gets_four_slots_of_context_in_one_shared_kv() -> None:
    args = server_args(DAY_SETUPS["report"], "direct", 8192)
    assert args == ["-np", "4", "-kvu", "-c", str(4 * 8192)]


def test_the_recommended_layout_keeps_its_flags_with_the_days_context() -> None:
    args = server_args(DAY_SETUPS["recommended"], "b512", 8192)
    assert args == ["-np", "5", "--no-cache-idle-slots", "-c", str(5 * 8192), "-b", "512"]


def test_automatic_slots_count_as_four_for_the_context() -> None:
    assert server_args(("-np", "-1"), "direct", 1024)[-2:] == ["-c", "4096"]


def test_slotwise_has_everything_on() -> None:
    plan = plan_day()
    tables = slotwise_tables(plan, "/kv", "/run/learned.json")
    assert tables["prefill"] == {"mode": "chunk", "cold_tokens": plan.long_tokens,
                                 "background_purposes": ["translation"],
                                 "learned_file": "/run/learned.json"}
    assert tables["lora"]["mode"] == "fixed"
    assert tables["warm"]["enabled"] is True
    assert tables["keep_kv"] == {"enabled": True, "dir": "/kv", "min_tokens": 1024}
    yesterday = slotwise_tables(plan, "/kv", "/run/learned.json", yesterday=True)
    assert yesterday["keep_kv"]["save_after_idle_s"] == 1.0


def test_the_chunk_path_turns_on_chunk_alone_and_is_played_only_when_asked() -> None:
    plan = plan_day()
    assert chunk_tables(plan) == {"prefill": {"mode": "chunk", "cold_tokens": plan.long_tokens}}
    assert "chunk" in PATHS and "chunk" not in DEFAULT_PATHS


def test_keep_kv_saves_the_returning_histories_at_any_scale() -> None:
    tiny = plan_day(0.05)
    assert tiny.keep_min_tokens() <= min(tiny.user("dan").yesterday_tokens,
                                         tiny.user("eve").yesterday_tokens)


def test_the_tables_thresholds_follow_the_scale() -> None:
    th = plan_day(0.5).thresholds()
    assert th.big_new == th.long_prefill == 750 and th.short_new == 750
    assert plan_day().thresholds().short_new == 1000


# -- the conversations ---------------------------------------------------------------------------

def test_a_returning_users_prompt_today_starts_with_what_was_saved_yesterday() -> None:
    dan = plan_day().user("dan")
    evening, today = talk.yesterday(dan, 19), talk.opening(dan, 19)
    assert today[:len(evening)] == evening
    assert today[-1] == {"role": "assistant", "content": talk.BYE}
    size = sum(len(m["content"].split()) for m in evening)
    assert size == pytest.approx(talk.words(dan.yesterday_tokens), rel=0.05)


def test_the_summary_comes_first_in_the_new_prompt_then_the_card_and_the_last_exchange() -> None:
    ann = plan_day().user("ann")
    before = [*talk.opening(ann, 19), {"role": "user", "content": "u"},
              {"role": "assistant", "content": "a"}]
    after = talk.folded(ann, 19, before, "SUMMARY")
    assert after[0]["role"] == "system"
    assert after[0]["content"].startswith("The story so far: SUMMARY")
    assert talk.card(ann, 19) in after[0]["content"]
    assert after[1:] == before[-2:]


def test_only_the_lora_client_sends_a_lora_field() -> None:
    plan, step = plan_day(), Step(Act.CHAT, 0.0, reply_tokens=50)
    assert talk.body([], step, plan.user("cho"))["lora"] == [{"id": 0, "scale": 0.0}]
    body = talk.body([], step, plan.user("ann"))
    assert "lora" not in body and body["max_tokens"] == 50 and body["stream"] is True


def test_every_request_says_who_and_what_for() -> None:
    headers = talk.headers(plan_day().user("ann"), Act.SUMMARY, "ann-3")
    assert headers == {"X-Slotwise-Client": "ann", "X-Slotwise-Purpose": "summary",
                       "X-Request-Id": "ann-3"}


# -- client-side records and the report's tables -------------------------------------------------

def result(sent: float, headers: float, tokens: list[float], prompt_n: int) -> StreamResult:
    return StreamResult(sent=sent, headers=headers, tokens=tokens, ended=tokens[-1] + 0.01,
                        status=200, timings={"prompt_n": prompt_n, "cache_n": 10})


def ticks(start: float, end: float, step: float) -> list[float]:
    return [round(start + i * step, 3) for i in range(int((end - start) / step) + 1)]


def call(key: str, act: Act, res: StreamResult, lora: list[dict[str, object]] | None = None,
         who: str | None = None) -> Call:
    return Call(key, who or key, act, "chat", lora, res)


def a_day() -> list[Call]:
    """A stream decoding through a long prefill, a short turn during it, one alone, and a turn
    with other LoRA settings that waits 2 s for its prefill."""
    return [
        call("stream", Act.CHAT, result(-2.0, -1.9, ticks(-1.8, 8.0, 0.05), 100)),
        call("long", Act.RETURN, result(0.0, 0.1, ticks(5.0, 6.0, 0.05), 3000), who="dan"),
        call("during", Act.CHAT, result(1.0, 5.0, ticks(5.2, 5.5, 0.05), 40)),
        call("lora", Act.CHAT, result(10.0, 12.0, ticks(12.1, 12.5, 0.05), 40),
             lora=[{"id": 0, "scale": 0.0}]),
        call("busy", Act.CHAT, result(9.5, 9.6, ticks(9.7, 12.0, 0.05), 40)),
        call("alone", Act.CHAT, result(20.0, 20.01, ticks(20.05, 20.5, 0.05), 30)),
    ]


def test_a_direct_record_has_the_client_side_figures_of_a_timing_record() -> None:
    calls = a_day()
    record = client_record(calls[2], calls, WALL)
    assert record["ttft_ms"] == pytest.approx(4200.0)
    assert record["prefill_wait_ms"] == pytest.approx(4000.0)
    assert record["computed_tokens"] == 40 and record["prompt_tokens"] == 50
    assert record["inflight_at_start"] == ["stream", "long"]
    assert record["outcome"] == "done" and record["kind"] == "chat"


def test_a_direct_prefill_starts_the_servers_prompt_ms_before_the_first_token() -> None:
    """Response headers may come before the slot starts (or with the first token): the server's
    own prompt time places the prefill, as the field report did."""
    res = result(0.0, 0.01, [5.0, 5.1], 3000)
    assert res.timings is not None
    res.timings["prompt_ms"] = 3000.0
    waited = call("x", Act.CHAT, res)
    assert waited.prefill == (pytest.approx(2.0), 5.0)
    assert client_record(waited, [waited], WALL)["prefill_wait_ms"] == pytest.approx(2000.0)


def test_overlaps_carry_the_decode_inside_anothers_prefill() -> None:
    calls = a_day()
    (ov,) = [o for o in client_record(calls[0], calls, WALL)["overlaps"] if o["id"] == "long"]
    assert ov["computed_tokens"] == 3000
    assert ov["from_ms"] == pytest.approx(2100.0) and ov["to_ms"] == pytest.approx(7000.0)
    assert ov["decode_events"] == 98 and ov["decode_ms"] == pytest.approx(4900.0)


def tables_of(calls: list[Call], tmp_path: object) -> dict[str, dict[str, object]]:
    from pathlib import Path

    import orjson

    path = Path(str(tmp_path)) / "client.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in client_records(calls, WALL)))
    log = load_timing_log(str(path))
    return report_tables(log.records, log, Thresholds(big_new=1000, long_prefill=1000,
                                                      short_new=500))


def rows(table: dict[str, object]) -> dict[str, dict[str, object]]:
    return {str(r["label"]): r for r in table["rows"]}  # type: ignore[attr-defined]


def test_the_reports_tables_are_built_from_the_client_records(tmp_path: object) -> None:
    tables = tables_of(a_day(), tmp_path)
    assert set(tables) == set(REPORT_KEYS)
    ttft = rows(tables["ttft_short"])
    assert ttft["nothing else running"]["n"] == 3  # the stream's, busy's and alone's turns
    assert ttft["overlapping other requests"]["n"] == 1  # lora's, beside busy
    assert ttft["overlapping a prefill of >= 1,000 tokens"]["n"] == 1  # during's
    waits = rows(tables["waits"])
    assert waits["requests with other LoRA settings"]["n"] == 1  # lora waited 2 s for busy
    assert waits["requests with the same LoRA settings"]["n"] == 1  # during waited 4 s
    assert waits["nothing"]["n"] == 0
    rate = rows(tables["decode_rate"])
    during = rate["while another slot prefilled >= 1,000 tokens"]
    assert during["n"] == 1 and during["values"][0] == pytest.approx(98 / 4.9)


def test_an_empty_log_gives_tables_with_empty_rows() -> None:
    tables = report_tables((), LoadedTimingLog("none", (), 0, ()), Thresholds())
    assert all(r["n"] == 0 for r in rows(tables["ttft_short"]).values())


# -- the day's own figures -----------------------------------------------------------------------

def test_the_days_figures_name_the_returning_and_post_summary_turns() -> None:
    calls = [*a_day(), call("ann-5", Act.RESUME, result(30.0, 30.1, [31.0, 31.2], 2000),
                            who="ann")]
    proxy = [{"id": "long", "restored_tokens": 2900, "policy_note": None},
             {"id": "ann-5", "warmed_tokens": 1900}]
    figures = day_figures(calls, proxy)
    (back,) = figures["returning"]
    assert back["who"] == "dan" and back["ttft_s"] == pytest.approx(5.0)
    assert back["restored_tokens"] == 2900 and back["prompt_tokens"] == 3010
    (after,) = figures["after_summary"]
    assert after["ttft_s"] == pytest.approx(1.0) and after["warmed_tokens"] == 1900
    assert figures["longest_gap_s"]["ann"] == pytest.approx(0.2)
    assert figures["longest_gap_s"]["everyone"] == pytest.approx(0.2)
    assert figures["failed"] == [] and figures["requests"] == 7
    events = sum(len(c.result.tokens) for c in calls)  # every stream's, over the 33.21 s day
    assert figures["events_per_s"] == pytest.approx(events / (31.21 + 2.0))


def test_first_tokens_by_purpose_keep_a_background_jobs_wait_apart() -> None:
    """The report's tables count a translation's wait among the short turns; slotwise lets the
    chat turns have a free slot first (background_purposes), so the day shows them apart."""
    job = Call("translator-0", "translator", Act.TRANSLATE, "translation", None,
               result(1.0, 1.1, [31.0, 31.5], 600))
    failed = Call("x", "x", Act.CHAT, "chat", None,
                  StreamResult(sent=2.0, headers=None, tokens=[], ended=2.1, status=500))
    figures = day_figures([*a_day(), job, failed])
    chat = figures["first_token_s"]["chat"]
    assert len(chat) == 6 and figures["first_token_s"]["translation"] == [pytest.approx(30.0)]
    text = " ".join(printed(day_grid([{"slotwise": figures}], "report")).split())
    assert "chat requests: time to first token (n) 6" in text
    assert "translation requests: time to first token (n) 1 median 30.0 s p90 30.0 s" in text


def test_the_longest_gap_names_the_prompts_computed_during_it() -> None:
    stream = call("bob-1", Act.CHAT, result(0.0, 0.1, [0.2, 0.5, 1.0, 2.0, 3.0, 5.0, 5.1], 200))
    whole = StreamResult(sent=2.5, headers=2.6, tokens=[5.05, 5.2], ended=5.3, status=200,
                         timings={"prompt_n": 264, "cache_n": 6000, "prompt_ms": 2000.0})
    before = call("eve-0", Act.CHAT, result(0.5, 0.6, [1.0, 1.1], 50))  # prefill over by then
    figures = day_figures([stream, call("dan-2", Act.CHAT, whole), before])
    assert figures["longest_gap_s"]["everyone"] == pytest.approx(2.0)
    assert figures["longest_gap_during"] == ["dan-2 (264 tokens)"]
    assert day_figures([before])["longest_gap_during"] == []
    runs = [{"slotwise": figures}, {"slotwise": day_figures([stream, before])}]
    text = printed(day_grid(runs, "report"))
    assert ("slotwise: dan-2 (264 tokens); no request's (slotwise's own work: a piece, a restore or"
            in " ".join(text.split()))


def test_a_failed_request_is_counted_and_has_no_gap() -> None:
    broken = call("x", Act.CHAT, StreamResult(sent=1.0, ended=2.0, status=0))
    figures = day_figures([broken])
    assert figures["failed"] == ["x"] and figures["longest_gap_s"] == {"x": None, "everyone": None}
    assert client_records([broken], WALL)[0]["outcome"] == "upstream_error"


def test_a_returning_user_who_finds_every_slot_taken_waits_until_the_first_comes_free() -> None:
    busy = [call(f"b{n}", Act.CHAT, result(0.0, 0.1, ticks(1.0, end, 0.5), 40))
            for n, end in enumerate((9.0, 7.0, 8.0, 12.0))]
    held = call("held", Act.CHAT, StreamResult(sent=1.0, ended=30.0, status=200))  # no slot yet
    back = call("back", Act.RETURN, result(5.0, 7.5, [8.0, 8.5], 60), who="dan")
    calls = [*busy, held, back]
    assert slot_wait(back, calls, 4) == pytest.approx(7.01 - 5.0)  # b1's end; `held` takes none
    assert slot_wait(back, calls, 5) == 0.0
    (turn,) = day_figures(calls, slots=4)["returning"]
    assert turn["slot_wait_s"] == pytest.approx(2.01)
    assert day_figures(calls)["returning"][0]["slot_wait_s"] is None  # slots not known


def test_the_days_table_counts_every_request_that_found_every_slot_taken() -> None:
    busy = [call(f"b{n}", Act.CHAT, result(0.0, 0.1, ticks(1.0, end, 0.5), 40))
            for n, end in enumerate((9.0, 7.0))]
    stuck = call("cho-0", Act.CHAT, StreamResult(sent=0.5, headers=None, tokens=[], ended=11.0,
                                                 status=200))  # in a slot, its prompt not begun
    late = [call("c", Act.CHAT, result(3.0, 9.5, [10.0, 10.5], 60)),  # waits for b1's slot
            call("d", Act.CHAT, result(8.0, 8.5, [9.0, 9.5], 60))]  # then for b0's
    figures = day_figures([*busy, stuck, *late], slots=3)
    assert figures["slot_waits"] == [pytest.approx(7.01 - 3.0), pytest.approx(9.01 - 8.0)]
    assert day_figures([*busy, *late])["slot_waits"] is None  # slots not known
    runs = [{"direct": figures, "slotwise": day_figures(busy, slots=3)}]
    lines = printed(day_grid(runs, "report")).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("requests that found"))
    assert lines[at].split()[-2:] == ["2", "0"]
    assert lines[at + 1].split()[-3:] == ["2.5", "s", "–"]  # the median wait
    assert lines[at + 2].split()[-3:] == ["4.0", "s", "–"]  # the longest


def test_a_cold_request_is_one_that_computed_a_long_prompt_on_its_own_path() -> None:
    """Through slotwise, the pieces fed first count as computed for the request; a restored
    history does not; a request cut before its first token has no size to time alone."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 300}

    def sent(key: str, res: StreamResult) -> Call:
        return Call(key, key, Act.CHAT, "chat", None, res, body=body)
    fed = sent("fed", result(0.0, 0.1, [9.0, 9.1], 200))  # 200 after 1,400 fed in pieces
    whole = sent("whole", result(0.0, 0.1, [5.0, 5.1], 1600))
    small = sent("small", result(0.0, 0.1, [1.0, 1.1], 1400))  # 1,400 restored: none computed
    cut = Call("cut", "cut", Act.CHAT, "chat", None, StreamResult(sent=0.0, ended=9.0), True,
               body=body)
    records = [{"id": "fed", "fed_tokens": 1400}, {"id": "small", "restored_tokens": 1400}]
    assert cold_calls([fed, whole, small, cut], records, 1500) == [fed, whole]


def test_a_cold_requests_first_token_is_put_against_its_own_time_alone() -> None:
    """ttft 9 s for 1,600 new tokens, whose prompt of 3,200 computed alone took 4 s: 2 s of
    its own, so it spent 7 s behind others or stretched beside them: 4.5× its time alone."""
    body = {"messages": [], "stream": True, "stream_options": {"include_usage": True}}
    late = Call("late", "bob", Act.CHAT, "chat", None, result(0.0, 0.1, [9.0, 9.1], 1600),
                body=body)
    (turn,) = day_figures([late], alone={"late": Alone(prompt_n=3200, prompt_ms=4000.0)})["cold"]
    assert turn["alone_s"] == pytest.approx(2.0) and turn["times_alone"] == pytest.approx(4.5)
    assert turn["who"] == "bob" and turn["new_tokens"] == 1600
    again = alone_body(late)
    assert again["cache_prompt"] is False and again["stream"] is False
    assert again["max_tokens"] == 1 and "stream_options" not in again
    assert day_figures([late])["cold"] == []  # nothing timed alone: no such figure


def test_the_days_table_shows_the_cold_requests_multiples_of_their_time_alone() -> None:
    def figures(ratios: list[float]) -> dict[str, object]:
        return {"returning": [], "after_summary": [], "longest_gap_s": {}, "failed": [],
                "cut": [], "day_s": 100.0,
                "cold": [{"who": "x", "times_alone": r} for r in ratios]}
    runs = [{"direct": figures([1.2, 30.0, 2.0]), "slotwise": figures([2.5, 2.1])}]
    lines = printed(day_grid(runs, "report")).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("cold requests"))
    assert lines[at].split()[-2:] == ["3", "2"]
    assert lines[at + 1].split()[-2:] == ["2.0×", "2.3×"]  # the medians
    assert lines[at + 2].split()[-2:] == ["30.0×", "2.5×"]  # the worst


# -- the tables ----------------------------------------------------------------------------------

def test_one_run_shows_the_value_several_the_median_and_range() -> None:
    assert cell([0.214], "s") == "214 ms"
    assert cell([0.3, 0.18, 0.25], "s") == "250 ms\n(180-300)"
    assert cell([0.8, 1.25, 1.0], "s") == "1.0 s\n(0.8-1.2)"  # the range in the median's unit
    assert cell([None, 45.3], "ev/s") == "45.3 ev/s\n(45.3-45.3)"
    assert cell([None], "s") == "–"
    assert cell([12], "") == "12"
    assert cell([0, 1], "") == "0\n(0-1)"  # a count's median is a count seen


def printed(table: Table, width: int = 80) -> str:
    out = io.StringIO()
    print_table(table, Console(file=out, width=width))
    return out.getvalue()


PATH_NAMES = ("direct", "direct -b 512", "slotwise")


def worst_run(tmp_path: object, factor: float) -> dict[str, dict[str, object]]:
    """A run whose figures are large (wide cells): a path's tables, scaled."""
    tables = tables_of(a_day(), tmp_path)
    for table in tables.values():
        for row in table["rows"]:  # type: ignore[attr-defined]
            row["values"] = [None if v is None else v * factor for v in row["values"]]
    return tables


@pytest.mark.parametrize("key", REPORT_KEYS)
def test_each_report_table_of_three_paths_and_three_runs_fits_80_columns(
        key: str, tmp_path: object) -> None:
    runs = [{p: worst_run(tmp_path, f * 123.4)[key] for p in PATH_NAMES} for f in (1, 2, 3)]
    text = printed(report_grid(runs, key, "report (-np 4 -kvu -c 49152), median (range) of 3"))
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_row_missing_on_one_path_shows_no_samples_there(tmp_path: object) -> None:
    tables = tables_of(a_day(), tmp_path)
    empty = {**tables["waits"], "rows": []}
    text = printed(report_grid([{"direct": tables["waits"], "slotwise": empty}], "waits"))
    line = next(t for t in text.splitlines() if "other LoRA" in t)
    assert line.split()[-2:] == ["1", "0"]


def test_the_days_table_fits_80_columns_with_every_figure() -> None:
    calls = [*a_day(), call("ann-5", Act.RESUME, result(30.0, 30.1, [31.0, 131.2], 2000),
                            who="ann")]
    figures = day_figures(calls, [{"id": "long", "restored_tokens": 123_456}], slots=1)
    runs = [{p: figures for p in PATH_NAMES} for _ in range(3)]
    text = printed(day_grid(runs, "recommended, median (range) of 3 runs"))
    assert "…" not in text and "(123,456-123,456)" in text
    assert "every slot taken" in text and "all streams" in text  # the labels wrap
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "returns:" in text and "summary:" in text  # the labels wrap beside the figures


def test_a_users_row_holds_that_users_turns_whatever_order_they_came_in() -> None:
    """bench day --repeat 3: ann's post-summary turn came before bob's in one run and after it
    in another; rows taken by position showed "bob after the summary" with ann's 2,478 tokens."""
    def figures(order: tuple[str, ...]) -> dict[str, object]:
        turns = {"ann": {"who": "ann", "ttft_s": 20.0, "prompt_tokens": 2479, "warmed_tokens": 500},
                 "bob": {"who": "bob", "ttft_s": 4.0, "prompt_tokens": 2094, "warmed_tokens": 900}}
        return {"returning": [], "after_summary": [turns[w] for w in order],
                "longest_gap_s": {}, "failed": [], "cut": [], "day_s": 300.0}
    runs = [{"slotwise": figures(o)} for o in (("ann", "bob"), ("bob", "ann"), ("bob", "ann"))]
    lines = printed(day_grid(runs, "report")).splitlines()
    ann = next(i for i, line in enumerate(lines) if line.startswith("ann after the summary"))
    bob = next(i for i, line in enumerate(lines) if line.startswith("bob after the summary"))
    assert lines[ann].split()[-2:] == ["20.0", "s"] and "2,479" in lines[ann + 2]
    assert lines[bob].split()[-2:] == ["4.0", "s"] and "2,094" in lines[bob + 2]


# -- the command line ----------------------------------------------------------------------------

def test_unknown_setups_and_paths_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"--setups: unknown nope \(valid: report"):
        _names("report,nope", list(DAY_SETUPS), "setups")
    assert _names(" report , recommended ", list(DAY_SETUPS), "setups") == ["report",
                                                                           "recommended"]


def test_run_day_stops_before_any_server_on_an_unknown_path(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(setups="report", paths="direct,chonk", scale=1.0, preset="tiny",
                              repeat=1, seed=19, json=False)
    assert run_day(args) == 2
    assert "--paths: unknown chonk" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "-1", "x", "11"])
def test_a_scale_out_of_range_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _scale(text)


def test_the_day_is_described_in_one_line() -> None:
    line = describe(plan_day())
    assert "dan 6,000, eve 4,000" in line and "long prefill >= 1,500" in line


def test_think_times_are_the_users_own() -> None:
    plan = plan_day()
    thinks = {u.name: [st.think_s for st in u.steps] for u in plan.users}
    assert all(a != b for a, b in itertools.combinations(thinks.values(), 2))


# -- the day played against a fake server on loopback ---------------------------------------------

Seen = list[tuple[str, dict[str, str], dict[str, Any]]]
"""What the fake server was sent: the path, the slotwise headers, the body."""


def fake_server(delay_s: float, seen: Seen, pause_s: float = 0.0) -> web.Application:
    """Answers every chat with a few tokens after `delay_s` (and `pause_s` after the first), and
    every warm-up with 202."""
    async def chat(request: web.Request) -> web.StreamResponse:
        await note(request)
        await asyncio.sleep(delay_s)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for n in range(3):
            await response.write(b'data: {"choices":[{"delta":{"content":"ab"}}]}\n\n')
            await asyncio.sleep(pause_s if n == 0 else 0.0)
        await response.write(b'data: {"choices":[],"timings":{"prompt_n":5,"cache_n":1,'
                             b'"prompt_ms":1.0}}\n\ndata: [DONE]\n\n')
        return response

    async def warm(request: web.Request) -> web.Response:
        await note(request)
        return web.json_response({"id": "w1", "state": "pending"}, status=202)

    async def note(request: web.Request) -> None:
        keys = ("X-Slotwise-Client", "X-Slotwise-Purpose", "X-Request-Id")
        seen.append((request.path, {k: request.headers.get(k, "") for k in keys},
                     await request.json()))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/slotwise/warm/v1/chat/completions", warm)
    return app


async def play_on_fake(plan: DayPlan, delay_s: float, *, warm: bool, pause_s: float = 0.0
                       ) -> tuple[list[Call], Seen]:
    from proxy.bench.day_run import play_day

    seen: Seen = []
    runner = web.AppRunner(fake_server(delay_s, seen, pause_s), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        calls, _, refused = await play_day(f"http://127.0.0.1:{port}", plan, warm=warm)
    finally:
        await runner.cleanup()
    assert refused == 0
    return calls, seen


async def test_every_request_of_the_day_is_sent_with_who_and_what_for() -> None:
    plan = plan_day(0.01)
    calls, seen = await play_on_fake(plan, 0.0, warm=True)
    assert len(calls) == plan.requests() and all(c.ok for c in calls)
    chats = {h["X-Request-Id"]: (h, body) for path, h, body in seen if path.startswith("/v1")}
    assert sorted({h["X-Slotwise-Purpose"] for h, _ in chats.values()}) == [
        "chat", "summary", "translation"]
    warmed = [h["X-Slotwise-Client"] for path, h, _ in seen if path.startswith("/slotwise")]
    assert warmed == ["ann", "bob"]  # their new prompts, right after their summaries
    resume = next(c for c in calls if c.act is Act.RESUME and c.who == "ann")
    first = chats[resume.id][1]["messages"][0]["content"]
    assert first.startswith("The story so far: ababab")  # the summary's reply, folded in


async def test_a_day_without_warm_ups_sends_none() -> None:
    _, seen = await play_on_fake(plan_day(0.01), 0.0, warm=False)
    assert not [path for path, _, _ in seen if path.startswith("/slotwise")]


async def test_a_day_that_stalls_is_cut_and_says_what_was_not_played() -> None:
    plan = replace(plan_day(0.01), limit_s=0.3)
    calls, _ = await play_on_fake(plan, 1.0, warm=False)
    assert calls and not any(c.ok for c in calls)  # those in flight when it was cut
    assert len(calls) < plan.requests()
    figures = day_figures(calls)
    assert figures["failed"] == [] and sorted(figures["cut"]) == sorted(c.id for c in calls)


async def test_a_reply_the_day_cuts_keeps_its_first_token_and_says_its_client_left() -> None:
    plan = replace(plan_day(0.01), limit_s=0.5)
    calls, _ = await play_on_fake(plan, 0.0, warm=False, pause_s=5.0)
    cut = [c for c in calls if c.cut]
    assert cut and all(c.ok and c.result.ttft is not None for c in cut)
    assert {r["outcome"] for r in client_records(cut, WALL)} == {"client_gone"}
    assert day_figures(calls)["failed"] == []


# -- on a real llama-server ----------------------------------------------------------------------

@pytest.mark.real_server
def test_a_tiny_day_is_played_on_every_path(llama_server_binary: object, tmp_path: object) -> None:
    """The whole day at a tiny scale on the report's layout: every request answered on every path,
    the report's tables and the day's figures made from each path's records."""
    from pathlib import Path

    from proxy.bench.day_run import run_path
    from proxy.testbed.model import write_model

    work = Path(str(tmp_path))
    model, plan = write_model(work / "model", "tiny"), plan_day(0.05)
    for path in PATHS:
        result = run_path(model, plan, DAY_SETUPS["report"], path, work / path, say=lambda _: None)
        assert set(result["tables"]) == set(REPORT_KEYS)
        figures = result["day"]
        assert figures["failed"] == [], path
        assert [t["who"] for t in figures["returning"]] == ["dan", "eve"]
        assert [t["who"] for t in figures["after_summary"]] == ["ann", "bob"]
        assert all(t["ttft_s"] is not None for t in figures["returning"])
        turns = rows(result["tables"]["ttft_short"])
        assert sum(int(r["n"]) for r in turns.values()) > 0  # type: ignore[call-overload]
        assert ("-b" in result["server_args"]) == (path == "b512")
    assert not (work / "slotwise" / "kv").exists()  # the KV files are deleted
    # the day's slotwise took up what yesterday's chat taught it: its follow-ups found their replies
    taken = re.search(r"taken up: .*, (\d+) follow-ups",
                      (work / "slotwise" / "slotwise" / "slotwise.log").read_text())
    assert taken is not None and int(taken.group(1)) >= 3
