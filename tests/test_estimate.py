"""The estimate's pure parts: the cache model with hand-made ids, prompt shapes, the combination."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.estimate import (
    CacheModel,
    Estimate,
    EstimateError,
    NotEstimable,
    UpstreamTokenizer,
    block_hashes,
    estimate,
)
from proxy.estimate.anthropic import messages_as_chat
from proxy.estimate.prompt import (
    check_kind,
    completion_prompt,
    given_ids,
    ids_of,
    tokenize_mixed,
)
from proxy.estimate.responses import responses_as_chat
from proxy.upstream import UpstreamClient


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class TestBlockHashes:
    def test_only_full_blocks(self) -> None:
        assert len(block_hashes(seq(0, 63))) == 0
        assert len(block_hashes(seq(0, 130))) == 2

    def test_chained_a_block_names_its_whole_prefix(self) -> None:
        a = seq(0, 128)
        b = [999, *seq(1, 127)]
        assert block_hashes(a)[1] != block_hashes(b)[1]  # same 2nd block, other prefix
        assert block_hashes(a) == block_hashes([*a, 5])


class TestCacheModel:
    def test_empty_model_caches_nothing(self) -> None:
        assert CacheModel(4, 8192).estimate_cached(seq(0, 1000)) == 0

    def test_a_conversation_a_restore_displaced_is_forgotten(self) -> None:
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 1000))
        cache.record(seq(1, 1000))
        cache.forget(block_hashes(seq(0, 1000)))
        assert cache.estimate_cached(seq(0, 1000)) == 0  # nor in RAM: a restore keeps no copy
        assert cache.estimate_cached(seq(1, 1000)) == 999  # the other slot's stays
        assert cache.ram_tokens == ()

    def test_longest_cached_prefix_to_the_token(self) -> None:
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 1000))
        assert cache.estimate_cached(seq(0, 1000) + seq(5000, 500)) == 1000
        assert cache.estimate_cached(seq(0, 700) + seq(5000, 500)) == 700
        assert cache.estimate_cached(seq(0, 9) + seq(5000, 30)) == 9  # less than a block
        assert cache.estimate_cached(seq(1, 1000)) == 0

    def test_a_reply_the_server_generated_is_cached_for_the_next_turn(self) -> None:
        """A slot holds its prompt and the reply it generated but its last token (sampled, never
        computed); the next turn repeats the reply (its ids unknown here), so up to that many of
        its tokens past the prompt are cached."""
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 1000), generated=265)
        follow_up = seq(0, 1000) + seq(5000, 265 + 54)
        assert cache.estimate_cached(follow_up) == 1264  # the reply's last token and the message
        assert cache.estimate_cached(seq(0, 1000) + seq(5000, 30)) == 1029  # shorter: all of it but one
        assert cache.estimate_cached(seq(0, 900) + seq(5000, 400)) == 900  # edited: no reply
        # the server found less than claimed (another reply text): cut back to what it said
        cache.record(follow_up, 1100)
        assert cache.estimate_cached(seq(0, 1000) + seq(7000, 300)) == 1000

    def test_how_much_of_a_reply_follow_ups_find_is_learned(self) -> None:
        """A template that renders a reply otherwise than it was generated (a reasoning model's
        drops the thinking): the server found 40 of 265 held tokens, three times; the estimate
        then counts that share of a held reply, and says the count is a guess until follow-ups
        were seen to find their reply whole."""
        cache = CacheModel(8, 65536)
        for k in range(3):
            history = seq(k * 10_000, 1000)
            cache.record(history, 0, generated=265)
            cache.record(history + seq(k * 10_000 + 5000, 265 + 54), 1040, generated=200)
        assert cache.replies.share() == pytest.approx(40 / 264)
        assert not cache.replies.found_whole()
        cache.record(seq(50_000, 1000), 0, generated=265)
        est = estimate(seq(50_000, 1000) + seq(55_000, 265 + 54), cache)
        assert est.new_tokens == 265 + 54 - 40
        assert est.guessed_tokens == 40

    def test_replies_found_whole_make_the_count_sure(self) -> None:
        """Found to the token, its last sampled one aside (never computed into the cache): whole,
        and the share all of it (counted as held, a 24-token reply was found at 96 %)."""
        cache = CacheModel(8, 65536)
        assert estimate(seq(0, 10), cache).guessed_tokens == 0  # no reply at stake
        cache.record(seq(0, 1000), 0, generated=265)
        assert estimate(seq(0, 1000) + seq(5000, 319), cache).guessed_tokens == 264  # not seen yet
        for k in range(3):
            history = seq(k * 10_000 + 100_000, 1000)
            cache.record(history, 0, generated=265)
            cache.record(history + seq(k * 10_000 + 105_000, 319), 1264, generated=200)
        assert cache.replies.found_whole() and cache.replies.share() == 1.0
        est = estimate(seq(0, 1000) + seq(5000, 319), cache)
        assert (est.new_tokens, est.guessed_tokens) == (319 - 264, 0)

    def test_a_lost_slot_says_nothing_of_replies(self) -> None:
        cache = CacheModel(8, 65536)
        cache.record(seq(0, 1000), 0, generated=265)
        cache.record(seq(0, 1000) + seq(5000, 319), 300)  # another took the slot
        cache.record(seq(0, 10) + seq(9000, 100), 0)  # no held reply repeated
        assert cache.replies.summary() == "no follow-up seen yet"

    def test_whole_prompt_cached_still_computes_one_token(self) -> None:
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 128))
        assert cache.estimate_cached(seq(0, 128)) == 127

    def test_best_of_several_slots(self) -> None:
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 300))
        cache.record(seq(10_000, 900))
        assert cache.estimate_cached(seq(10_000, 2000)) == 900
        assert cache.estimate_cached(seq(0, 2000)) == 300

    def test_extension_replaces_its_own_entry(self) -> None:
        cache = CacheModel(2, 8192)
        cache.record(seq(0, 256))
        cache.record(seq(0, 512))  # a piece extends the same slot
        cache.record(seq(0, 768))
        assert cache.entries == 1
        assert cache.cached_tokens == (768,)

    def test_a_prompt_sharing_little_takes_a_new_slot_like_the_server(self) -> None:
        cache = CacheModel(4, 8192)
        short = [7, 8, 9, *seq(100, 40)]
        cache.record(short)
        cache.record([7, *seq(5000, 3000)])  # a cold prompt shares one token: not the same slot
        assert cache.entries == 2
        assert cache.estimate_cached([7, 8, 9, *seq(100, 7), *seq(900, 30)]) == 10

    def test_lru_bounded_by_slot_count(self) -> None:
        cache = CacheModel(2, 8192, ram_tokens=0)  # the slots alone: no RAM cache behind them
        cache.record(seq(0, 256))
        cache.record(seq(1000, 256))
        cache.estimate_cached(seq(0, 256))  # an estimate is not a use
        cache.record(seq(0, 320))  # touches the first entry
        cache.record(seq(2000, 256))  # evicts the least recently used: 1000..
        assert cache.entries == 2
        assert cache.estimate_cached(seq(1000, 256)) == 0
        assert cache.estimate_cached(seq(0, 400)) == 320

    def test_a_history_that_lost_its_slot_to_the_least_recently_used_is_found_in_ram(self) -> None:
        """ann's 2,000 tokens left her slot when the translator's new prompt took it; the
        server copied them to its RAM cache (--cache-ram, on by default), and her next turn,
        sent whole, restores them there: it is not cold."""
        cache = CacheModel(2, 8192)
        ann = seq(0, 2000)
        cache.record(ann)
        cache.record(seq(10_000, 500))
        cache.record(seq(20_000, 600))  # the least recently used slot: ann's
        assert cache.cached_tokens == (500, 600) and cache.ram_tokens == (2000,)
        assert cache.estimate_cached([*ann, *seq(5000, 50)]) == 2000
        assert cache.found([*ann, *seq(5000, 50)]) == (0, 2000)  # none of it in a slot

    def test_a_piece_under_a_quarter_of_a_history_in_ram_does_not_restore_it(self) -> None:
        """llama-server restores an entry only for a prompt keeping a quarter of it: a 64-token
        first piece of ann's next turn would compute everything again."""
        cache = CacheModel(1, 8192)
        cache.record(seq(0, 2000))
        cache.record(seq(10_000, 500))
        assert cache.estimate_cached(seq(0, 499)) == 0
        assert cache.estimate_cached(seq(0, 500)) == 499  # a quarter: found (one token computed)

    def test_a_history_restored_from_ram_leaves_it(self) -> None:
        cache = CacheModel(1, 8192)
        cache.record(seq(0, 2000))
        cache.record(seq(10_000, 500))
        cache.record([*seq(0, 2000), *seq(5000, 50)], cache_n_reported=2000)
        assert cache.ram_tokens == (500,)  # the translator's, copied out as ann's came back
        assert cache.cached_tokens == (2050,)

    def test_a_prompt_taking_a_slot_by_similarity_but_keeping_little_of_it_copies_it_to_ram(
            self) -> None:
        """A new conversation sharing the template's first 64 tokens takes ann's idle slot (over
        10 % of its prompt is shared) and keeps under half of it: the server copies hers out
        first."""
        cache = CacheModel(4, 8192)
        template = seq(0, 64)
        ann = [*template, *seq(100, 1936)]
        cache.record(ann)
        cache.record([*template, *seq(50_000, 200)])
        assert cache.entries == 1 and cache.ram_tokens == (2000,)
        assert cache.estimate_cached([*ann, *seq(9000, 10)]) == 2000

    def test_a_slot_kept_by_similarity_is_not_looked_past_to_ram(self) -> None:
        """A prompt keeping half its slot's prompt or more stays in that slot: the server does
        not look in RAM then, whatever it holds."""
        cache = CacheModel(1, 8192)
        cache.record(seq(0, 3000))
        cache.record(seq(0, 1000) + seq(7000, 200))  # keeps 1,000 of 3,000: RAM gets the 3,000
        cache.record(seq(0, 1000) + seq(7000, 200) + seq(8000, 100))
        assert cache.ram_tokens == (3000,)
        assert cache.estimate_cached(seq(0, 3000)) == 1000  # keeps 1,000 of the slot's 1,300
        assert cache.estimate_cached(seq(0, 1000) + seq(7000, 200) + seq(6000, 5)) == 1200

    def test_a_server_without_a_ram_cache_turns_it_off_at_the_first_miss(self) -> None:
        """llama-server run with --cache-ram 0: the first prompt predicted from RAM finds
        nothing; from then on nothing is predicted from RAM."""
        cache = CacheModel(1, 8192)
        cache.record(seq(0, 2000))
        cache.record(seq(10_000, 500))
        cache.record([*seq(0, 2000), *seq(5000, 50)], cache_n_reported=0)
        assert cache.ram_off and cache.ram_tokens == ()
        cache.record(seq(30_000, 500))  # the 2,050 leave the slot: not modelled in RAM now
        assert cache.estimate_cached(seq(0, 2050)) == 0

    def test_a_prompt_the_ram_entry_holds_whole_is_a_hit_though_one_token_is_computed(
            self) -> None:
        """bench day: the first RAM use of the day was a trim piece inside `dan`'s history, which
        found all of it but the one token llama-server always computes; taken for a miss, the
        RAM cache was declared off and every later turn whose history had left its slot was
        judged cold. A hit; so is one that found less than the entry but more than any slot."""
        for piece, found in ((1500, 1499), (1500, 1200)):
            cache = CacheModel(1, 8192)
            cache.record(seq(0, 2000))
            cache.record(seq(10_000, 500))  # ann's 2,000 to RAM
            cache.record(seq(0, piece), cache_n_reported=found)
            assert not cache.ram_off, (piece, found)
            cache.record(seq(20_000, 500))  # ann's prefix leaves the slot again: to RAM
            assert cache.estimate_cached([*seq(0, piece), 7]) == piece, (piece, found)

    def test_a_ram_cache_taken_for_off_is_on_again_once_a_prompt_finds_more_than_the_slots(
            self) -> None:
        """A first miss (an entry the server had evicted) is no proof for the rest of the day:
        a prompt that finds a block or more beyond what any slot held found it in RAM."""
        cache = CacheModel(1, 8192)
        cache.record(seq(0, 2000))
        cache.record(seq(10_000, 500))
        cache.record([*seq(0, 2000), *seq(5000, 50)], cache_n_reported=0)
        assert cache.ram_off
        cache.record([*seq(0, 2050), 7], cache_n_reported=2050)  # its own slot: no proof
        assert cache.ram_off
        cache.record(seq(40_000, 500))  # the 2,051 leave the slot: not modelled in RAM now
        assert cache.estimate_cached([*seq(0, 2051), 8]) == 0
        cache.record([*seq(0, 2051), 8], cache_n_reported=2051)  # beyond any slot: RAM
        assert not cache.ram_off
        cache.record(seq(50_000, 500))  # the 2,053 leave the slot: in RAM now
        assert cache.estimate_cached([*seq(0, 2051), 8, 9]) == 2052

    def test_a_ram_cache_that_delivered_once_only_loses_its_evicted_entries(self) -> None:
        cache = CacheModel(1, 8192)
        for start in (0, 10_000, 20_000):  # 0.. and 10_000.. in RAM, 20_000.. in the slot
            cache.record(seq(start, 1000))
        cache.record([*seq(10_000, 1000), 7], cache_n_reported=1000)  # a hit: 20_000.. to RAM
        cache.record([*seq(0, 1000), 7], cache_n_reported=0)  # evicted by the byte limit
        assert not cache.ram_off and cache.estimate_cached(seq(20_000, 1000)) == 999

    def test_the_ram_cache_keeps_its_room_evicting_the_oldest(self) -> None:
        cache = CacheModel(1, 8192, ram_tokens=2500)
        for start in (0, 10_000, 20_000, 30_000):
            cache.record(seq(start, 1000))
        assert cache.ram_tokens == (1000, 1000)  # 10_000.. and 20_000..; 0.. evicted
        assert cache.estimate_cached(seq(0, 1000)) == 0

    def test_bounded_by_context(self) -> None:
        cache = CacheModel(4, 256)
        cache.record(seq(0, 1000))
        assert cache.estimate_cached(seq(0, 1000)) == 256

    def test_bounded_by_total_tokens(self) -> None:
        cache = CacheModel(4, 8192, max_total_tokens=1024)
        cache.record(seq(0, 640))
        cache.record(seq(5000, 640))
        assert cache.entries == 1
        assert cache.estimate_cached(seq(5000, 700)) == 640

    def test_server_reports_less_then_trust_the_server(self) -> None:
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 1024))
        prompt = seq(0, 1024) + seq(9000, 100)
        assert cache.estimate_cached(prompt) == 1024
        cache.record(prompt, cache_n_reported=200)  # it had only 200 of them
        assert cache.estimate_cached(prompt) == 1123  # the new prompt itself is now cached
        assert cache.estimate_cached(seq(0, 1024) + seq(7000, 64)) == 1024

    def test_server_reports_less_cuts_stale_entries(self) -> None:
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 1024))
        cache.record(seq(0, 512) + seq(3000, 512))
        # A third prompt sharing 512 tokens: the server found none of them (evicted).
        third = seq(0, 512) + seq(7000, 64)
        cache.record(third, cache_n_reported=0)
        assert cache.estimate_cached(seq(0, 1024)) == 512  # only the third entry holds 0..511
        assert cache.entries == 1  # emptied entries are dropped

    def test_a_new_conversation_finding_less_than_the_shared_template_cuts_nobody(self) -> None:
        template = seq(0, 18)
        cache = CacheModel(4, 8192)
        users = [template + seq(1000 * (u + 1), 2000) for u in range(3)]
        for ids in users:
            cache.record(ids)
        newcomer = template + seq(9000, 2000)
        assert cache.estimate_cached(newcomer) == 18
        cache.record(newcomer, cache_n_reported=7)  # the slot the server took held 7 of them
        for ids in users:
            assert cache.estimate_cached([*ids, 5]) == len(ids)

    def test_a_first_piece_must_outgrow_the_chat_template_it_shares_with_a_slot(self) -> None:
        """llama-server puts a prompt into the slot it shares more than a tenth of itself with: a
        new conversation sharing the template's first 23 tokens with one in a slot goes to the
        least recently used slot whole, but a first piece of it under 231 tokens would not."""
        cache = CacheModel(4, 8192)
        template = seq(0, 23)
        cache.record([*template, *seq(1000, 1975)])
        newcomer = [*template, *seq(5000, 1977)]
        assert cache.first_piece_floor(newcomer) == 231
        assert 23 / 231 < 0.1  # a piece this long shares under a tenth of itself
        assert cache.first_piece_floor(seq(9000, 2000)) == 0  # nothing shared
        assert cache.first_piece_floor([*template, *seq(5000, 100)]) == 0  # shared > a tenth:
        # the whole prompt goes to that slot too, and so does every piece of it
        assert cache.first_piece_floor([*template, *seq(5000, 207)]) == 230  # never past itself

    def test_server_reports_more_is_kept(self) -> None:
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 512), cache_n_reported=400)
        assert cache.estimate_cached(seq(0, 600)) == 512

    def test_clear(self) -> None:
        cache = CacheModel(1, 8192)
        cache.record(seq(0, 512))
        cache.record(seq(1000, 512))
        cache.clear()
        assert cache.estimate_cached(seq(0, 512)) == 0  # nor in RAM
        assert cache.estimate_cached(seq(1000, 512)) == 0

    def test_bad_sizes(self) -> None:
        with pytest.raises(ValueError, match="n_slots"):
            CacheModel(0, 8192)


class TestEstimate:
    def test_new_tokens_are_those_not_cached(self) -> None:
        cache = CacheModel(4, 8192)
        cache.record(seq(0, 1000))
        est = estimate(seq(0, 1000) + seq(5000, 40), cache)
        assert est == Estimate(prompt_tokens=1040, new_tokens=40)
        assert est.cached_tokens == 1000

    def test_without_cache_model_all_new(self) -> None:
        assert estimate(seq(0, 10)) == Estimate(10, 10)


class TestPromptShapes:
    @pytest.mark.parametrize(("prompt", "expected"), [
        ("hello", "hello"),
        ([1, 2, 3], [1, 2, 3]),
        ([1, "a", 2], [1, "a", 2]),
        (["only one"], "only one"),
        ([[5, 6]], [5, 6]),
        ({"prompt_string": "x"}, "x"),
        ({"prompt_string": [7, "y"]}, [7, "y"]),
    ])
    def test_single_prompt(self, prompt: Any, expected: Any) -> None:
        assert completion_prompt({"prompt": prompt}) == expected

    @pytest.mark.parametrize(("prompt", "why"), [
        (["a", "b"], "2 prompts"),
        ([[1], [2]], "2 prompts"),
        ([], "0 prompts"),
        ({"prompt_string": "x", "multimodal_data": ["AA=="]}, "multimodal"),
        ({"text": "x"}, "prompt_string"),
        ([1, 2.5], "only token ids and strings"),
        ([1, True], "only token ids and strings"),
        (3, "type int"),
    ])
    def test_not_estimable(self, prompt: Any, why: str) -> None:
        with pytest.raises(NotEstimable, match=why):
            completion_prompt({"prompt": prompt})

    def test_missing_prompt(self) -> None:
        with pytest.raises(NotEstimable, match="no 'prompt'"):
            completion_prompt({})

    def test_given_ids(self) -> None:
        assert given_ids([3, 4]) == [3, 4]
        assert given_ids([3, "x"]) is None
        assert given_ids("x") is None

    def test_tokenize_mixed_adds_special_only_first_string(self) -> None:
        calls: list[tuple[str, bool]] = []

        def fake(text: str, add_special: bool) -> list[int]:
            calls.append((text, add_special))
            return [len(text)]

        assert tokenize_mixed("abc", fake) == [3]
        assert tokenize_mixed(["ab", 9, "cde"], fake) == [2, 9, 3]
        assert tokenize_mixed([9, "ab"], fake) == [9, 2]
        assert calls == [("abc", True), ("ab", True), ("cde", False), ("ab", False)]

    def test_kinds(self) -> None:
        for kind in ("chat", "completion", "completions", "messages", "responses"):
            check_kind(kind)
        with pytest.raises(NotEstimable, match="infill"):
            check_kind("infill")

    def test_ids_of(self) -> None:
        assert ids_of([1, 2]) == [1, 2]
        with pytest.raises(Exception, match="token ids"):
            ids_of([1, "x"])


async def test_unreachable_upstream_is_an_estimate_error() -> None:
    async with aiohttp.ClientSession() as session:
        await _unreachable(session)


async def _unreachable(session: aiohttp.ClientSession) -> None:
    upstream = UpstreamTokenizer(UpstreamClient(session, lambda: "http://127.0.0.1:9"),
                                 timeout_s=2.0)
    with pytest.raises(EstimateError, match="/apply-template failed"):
        await upstream.tokenize_request("chat", {"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(NotEstimable):
        await upstream.tokenize_request("completion", {"prompt": ["a", "b"]})


class TestAnthropicMessages:
    """The chat body llama-server makes of a /v1/messages body (server_chat_convert_anthropic_to_oai)."""

    def test_system_blocks_join_and_the_billing_hash_is_blanked(self) -> None:
        body = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1; cch=a5145;"},
                           {"type": "text", "text": "You are helpful."}],
                "messages": []}
        assert messages_as_chat(body)["messages"] == [{"role": "system", "content":
            "x-anthropic-billing-header: cc=1; cch=fffff;You are helpful."}]

    def test_blocks_become_content_tool_calls_reasoning_and_tool_messages(self) -> None:
        body = {"messages": [
            {"role": "assistant"},  # no content: dropped, as the server does
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": [2]}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
                {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}},
                {"type": "text", "text": "next"}]}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"}}
        chat = messages_as_chat(body)
        assert chat["messages"] == [
            {"role": "assistant", "content": "", "reasoning_content": "hm",
             "tool_calls": [{"id": "t1", "type": "function",
                             "function": {"name": "f", "arguments": '{"b":1,"a":[2]}'}}]},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/i.png"}},
                {"type": "text", "text": "next"}]},
            {"role": "tool", "tool_call_id": "t1", "content": "ok"}]
        assert chat["tools"] == [{"type": "function", "function": {
            "name": "f", "description": "", "parameters": {"type": "object"}}}]
        assert chat["tool_choice"] == "required"

    def test_a_body_without_messages_is_not_estimable(self) -> None:
        with pytest.raises(NotEstimable, match="'messages'"):
            messages_as_chat({"system": "hi"})


class TestResponses:
    """The chat body llama-server makes of a /v1/responses body."""

    def test_items_become_messages_tool_calls_and_tool_results(self) -> None:
        body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 9,
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                "input": [
                    {"role": "developer", "content": "Norwegian."},
                    {"role": "user", "content": "Hi", "type": "message", "status": "done"},
                    {"type": "reasoning", "summary": [], "content": [{"text": "think"}]},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                    {"type": "message", "role": "assistant",
                     "content": [{"type": "output_text", "text": "Done."}]},
                    {"type": "web_search_call"}]}
        chat = responses_as_chat(body)
        assert chat["messages"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": [{"text": "Norwegian.", "type": "text"}]},
            {"role": "user", "content": [{"text": "Hi", "type": "text"}]},
            {"role": "assistant", "content": [], "reasoning_content": "think",
             "tool_calls": [{"type": "function", "id": "c1",
                             "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "assistant", "content": [{"text": "Done.", "type": "text"}]}]
        assert chat["tools"] == [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}]
        assert chat["max_output_tokens"] == 9 and "input" not in chat and "instructions" not in chat

    def test_a_body_without_input_is_not_estimable(self) -> None:
        with pytest.raises(NotEstimable, match="'input'"):
            responses_as_chat({"instructions": "hi"})
