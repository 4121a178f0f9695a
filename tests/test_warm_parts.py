"""The pure parts around the warm-up queue: the stable prefix's bodies, same-conversation matching,
piece sizes from the batch cost, the load the queue decides by, the record, the views and the
`[warm]` config table."""

from __future__ import annotations

from array import array

import pytest

from proxy.config import ConfigError, parse_config
from proxy.estimate import NotEstimable
from proxy.record.outcome import Outcome
from proxy.report.reports import timing_report
from proxy.report.tables import Thresholds
from proxy.report.warm_table import warm_table
from proxy.warm.prefix import PROBE, chat_renders, common_prefix, same_conversation
from proxy.warm.record import warm_flight, warm_record
from proxy.warm.values import WarmKnobs, WarmUp
from proxy.warm.views import status_view, warm_view

HISTORY = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


class TestStablePrefixBodies:
    def test_a_chat_body_is_rendered_without_and_with_a_next_turn(self) -> None:
        so_far, turn = chat_renders("chat", {"messages": HISTORY, "stream": True})
        assert so_far == {"messages": HISTORY, "stream": True, "add_generation_prompt": False}
        assert turn["messages"] == [*HISTORY, PROBE] and turn["add_generation_prompt"] is True

    def test_an_anthropic_body_becomes_its_chat_body(self) -> None:
        so_far, _ = chat_renders("messages", {"system": "be brief", "messages": HISTORY})
        assert so_far["messages"][0] == {"role": "system", "content": "be brief"}

    def test_a_responses_body_becomes_its_chat_body(self) -> None:
        so_far, _ = chat_renders("responses", {"instructions": "be brief", "input": "hi"})
        assert so_far["messages"] == [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"}]

    @pytest.mark.parametrize(("kind", "body", "message"), [
        ("chat", {"messages": []}, "no messages to warm"),
        ("chat", {"prompt": "x"}, "no messages to warm"),
        ("messages", {"system": "x"}, "without a 'messages' array"),
        ("completion", {"prompt": "x"}, "no conversation"),
    ])
    def test_a_body_with_nothing_to_warm_is_refused(self, kind: str, body: dict[str, object],
                                                    message: str) -> None:
        with pytest.raises(NotEstimable, match=message):
            chat_renders(kind, body)


class TestSameConversation:
    def test_common_prefix_of_lists_and_arrays(self) -> None:
        a = list(range(1000))
        assert common_prefix(a, array("l", a[:700] + [-1] * 10)) == 700
        assert common_prefix(array("l", a), a) == 1000 and common_prefix([], a) == 0

    def test_a_prompt_carrying_nine_tenths_of_the_prefix_is_of_its_conversation(self) -> None:
        assert same_conversation(900, 1000) and not same_conversation(899, 1000)
        assert not same_conversation(0, 0)


def ended_warm() -> WarmUp:
    w = WarmUp(id="warm-1", client="ann", ids=list(range(3000)), cached=100, submitted=10.0,
               done_upto=2000, pieces=3, computed=1900, started=11.0, ended=20.0,
               outcome=Outcome.SUPERSEDED, reason="a request of the same conversation arrived")
    return w


class TestRecordAndViews:
    def test_the_record_of_a_warm_up(self) -> None:
        flight = warm_flight("warm-1", "/slotwise/warm/v1/chat/completions", now=10.0, wall=0.0,
                             config_gen=1, client="ann", purpose=None, node="n")
        flight.status = 202
        flight.timer.on_end(20.0)
        record = warm_record(flight, ended_warm())
        assert (record.kind, record.outcome, record.status) == ("warm", "superseded", 202)
        assert (record.pieces, record.fed_tokens, record.prefill_plan) == (3, 1900, "chunked")
        assert (record.est_prompt_tokens, record.est_new_tokens) == (3000, 2900)
        assert record.held_ms == 1000.0 and record.total_ms == 10000.0
        assert record.policy_note == "a request of the same conversation arrived"
        assert record.error is None and record.warmed_tokens == 0

    def test_views_show_no_ids_and_say_how_it_ended(self) -> None:
        view = warm_view(ended_warm(), WarmKnobs(), 30.0)
        assert view["state"] == "ended" and view["outcome"] == "superseded"
        assert view["computed_tokens"] == 1900 and "ids" not in view
        pending = WarmUp(id="p", client=None, ids=list(range(500)), cached=0, submitted=25.0)
        status = status_view([ended_warm(), pending], WarmKnobs(expire_s=60.0), True,
                             {"superseded": 1}, 30.0)
        assert [w["id"] for w in status["pending"]] == ["p"] and status["running"] == []
        assert status["pending"][0]["expires_in_s"] == 55.0
        assert status["ended"]["superseded"] == 1 and status["ended"]["done"] == 0


    def test_a_clients_view_shows_nothing_of_what_the_server_held_when_caches_are_private(
            self) -> None:
        view = warm_view(ended_warm(), WarmKnobs(), 30.0, private=True)
        assert view["state"] == "ended" and view["outcome"] == "superseded"
        assert not {"cached", "est_tokens", "done_tokens", "computed_tokens", "pieces",
                    "reason"} & set(view)


class TestConfig:
    def test_caches_are_each_clients_own_with_client_keys_unless_shared_on_purpose(self) -> None:
        keys = {"clients": [{"name": "alice", "key": "k1"}, {"name": "bob", "key": "k2"}]}
        assert parse_config({"access": keys}).access.isolates_caches
        assert not parse_config({"access": {**keys, "cache_scope": "shared"}}).access.isolates_caches
        assert not parse_config({}).access.isolates_caches  # one tenant: nothing to isolate
        with pytest.raises(ConfigError, match=r"access\.cache_scope: "):
            parse_config({"access": {**keys, "cache_scope": "mine"}})

    def test_defaults_suit_a_small_team(self) -> None:
        warm = parse_config({}).warm
        assert warm.enabled and warm.max_pending == 8 and warm.max_per_client == 2
        assert warm.max_tokens == 32768 and warm.expire_s == 300.0

    @pytest.mark.parametrize(("table", "message"), [
        ({"enabled": "yes"}, "warm.enabled: expected true or false, got 'yes'"),
        ({"max_pending": 0}, "warm.max_pending: 0 is out of range"),
        ({"max_tokens": 10}, "warm.max_tokens: 10 is out of range"),
        ({"expire": 5}, "warm.expire: unknown key (valid: enabled, max_pending, max_tokens"),
    ])
    def test_bad_values_name_the_dotted_key(self, table: dict[str, object], message: str) -> None:
        with pytest.raises(ConfigError) as info:
            parse_config({"warm": table})
        assert message in str(info.value)


class TestReportTable:
    def records(self) -> list[dict[str, object]]:
        def turn(rid: str, ttft: float, warmed: int, ids: list[str], new: int) -> dict[str, object]:
            return {"id": rid, "kind": "chat", "outcome": "done", "ttft_ms": ttft,
                    "warmed_tokens": warmed, "warm_ids": ids,
                    "timings": {"prompt_n": new, "cache_n": 3000 - new}}
        return [
            {"id": "w1", "kind": "warm", "outcome": "done", "fed_tokens": 3000},
            {"id": "w2", "kind": "warm", "outcome": "superseded", "fed_tokens": 1000},
            {"id": "w3", "kind": "warm", "outcome": "expired", "fed_tokens": 2000},
            {"id": "w4", "kind": "warm", "outcome": "done", "fed_tokens": 0},  # already cached
            turn("t1", 200.0, 3000, ["w1"], 20), turn("t2", 900.0, 1000, ["w2"], 2000),
            turn("t3", 4000.0, 0, [], 3000), turn("t4", 60.0, 0, [], 30),
        ]

    def test_warm_ups_hits_and_warmed_against_cold_turns(self) -> None:
        table = warm_table(self.records(), cold_tokens=1000)
        rows = {r.label.strip(): r for r in table.rows}
        assert rows["warm-ups"].n == 4 and rows["warm-ups"].values[1] == 6000
        assert rows["done"].n == 2 and rows["expired"].values[0] == 25.0
        hits = rows["found by a later turn (hits)"]
        assert hits.n == 2 and hits.values[0] == pytest.approx(100 * 2 / 3)  # of those that computed
        warmed = rows["warmed turns"]
        assert warmed.n == 2 and warmed.values[2] == pytest.approx(0.55)  # median of 0.2 s, 0.9 s
        cold = next(r for label, r in rows.items() if label.startswith("cold turns"))
        assert cold.n == 1 and cold.values[2] == 4.0  # t4 computed too little to be cold

    def test_the_report_shows_it_only_where_there_are_warm_ups(self) -> None:
        th = Thresholds()
        records = [{**r, "_t0": 0.0, "start": "2025-01-01T00:00:00+00:00"} for r in self.records()]
        keys = [t.key for t in timing_report("t", records, None, th).tables]
        assert "warm" in keys
        plain = [r for r in records if r["kind"] != "warm" and not r.get("warmed_tokens")]
        assert "warm" not in [t.key for t in timing_report("t", plain, None, th).tables]
