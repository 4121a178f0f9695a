"""The prompt ids cache (`proxy/estimate/ids_cache.py`): one class per rule of `PromptIdsCache`, then
its key. Pure: the time is a plain number."""

from __future__ import annotations

import sys
from array import array

from proxy.estimate.ids_cache import MAX_ENTRY_TOKENS, MAX_TOKENS, PromptIdsCache, body_key


class TestRule1AHitAnswersACopyOfTheIds:
    def test_a_stored_key_is_a_hit_and_another_a_miss(self) -> None:
        cache = PromptIdsCache()
        cache.put("a", [1, 2, 3], 0.0)
        assert cache.get("a", 1.0) == [1, 2, 3]
        assert cache.get("b", 1.0) is None
        assert (cache.counts.hits, cache.counts.misses) == (1, 1)


class TestRule2AgedOutOnEveryAccess:
    def test_an_old_entry_is_not_used(self) -> None:
        cache = PromptIdsCache(max_age_s=10.0)
        cache.put("a", [1], 0.0)
        assert cache.get("a", 10.0) == [1]
        assert cache.get("a", 10.5) is None
        assert len(cache) == 0 and cache.tokens == 0

    def test_a_put_drops_every_entry_past_its_age(self) -> None:
        cache = PromptIdsCache(max_age_s=10.0)
        cache.put("a", [1] * 100, 0.0)
        cache.put("b", [2] * 100, 5.0)
        cache.put("c", [3], 12.0)  # "a" is 12 s old: gone, though nobody asked for it
        assert len(cache) == 2 and cache.tokens == 101
        cache.put("d", [4], 30.0)
        assert len(cache) == 1 and cache.tokens == 1

    def test_a_get_of_another_key_drops_them_too(self) -> None:
        cache = PromptIdsCache(max_age_s=10.0)
        cache.put("a", [1] * 100, 0.0)
        assert cache.get("b", 11.0) is None
        assert len(cache) == 0 and cache.tokens == 0

    def test_expire_drops_them_with_no_lookup(self) -> None:
        cache = PromptIdsCache(max_age_s=10.0)
        cache.put("a", [1], 0.0)
        cache.expire(11.0)
        assert len(cache) == 0


class TestRule3AnEntryOverItsCapIsNotStored:
    def test_more_than_max_entry_tokens(self) -> None:
        cache = PromptIdsCache(max_entry_tokens=4)
        assert cache.put("a", [1, 2, 3, 4], 0.0)
        assert not cache.put("b", [1, 2, 3, 4, 5], 0.0)
        assert cache.get("b", 0.0) is None and cache.tokens == 4

    def test_more_than_one_slot_holds(self) -> None:
        cache = PromptIdsCache()
        assert not cache.put("a", list(range(101)), 0.0, limit=100)
        assert cache.put("a", list(range(100)), 0.0, limit=100)
        assert cache.tokens == 100

    def test_a_slot_larger_than_the_ceiling_does_not_lift_it(self) -> None:
        cache = PromptIdsCache(max_entry_tokens=4)
        assert not cache.put("a", [1] * 5, 0.0, limit=1_000_000)

    def test_the_default_ceiling_is_bounded_and_below_the_total(self) -> None:
        assert MAX_ENTRY_TOKENS <= MAX_TOKENS // 8
        assert PromptIdsCache().put("a", [1] * (MAX_ENTRY_TOKENS + 1), 0.0) is False

    def test_ids_outside_32_bits_are_not_stored(self) -> None:
        cache = PromptIdsCache()
        assert not cache.put("a", [1, 2**40], 0.0)
        assert len(cache) == 0

    def test_a_refused_entry_drops_an_older_one_under_its_key(self) -> None:
        cache = PromptIdsCache(max_entry_tokens=4)
        cache.put("a", [1], 0.0)
        cache.put("a", [1] * 5, 1.0)
        assert cache.get("a", 1.0) is None and cache.tokens == 0


class TestRule4BoundedInEntriesAndTokens:
    def test_at_most_entries_the_oldest_going_first(self) -> None:
        cache = PromptIdsCache(entries=2)
        cache.put("a", [1], 0.0)
        cache.put("b", [2], 1.0)
        assert cache.get("a", 1.5) == [1]  # a lookup does not make an entry younger (rule 2)
        cache.put("c", [3], 2.0)
        assert cache.get("a", 2.0) is None
        assert cache.get("b", 2.0) == [2] and cache.get("c", 2.0) == [3]

    def test_at_most_max_tokens_in_all(self) -> None:
        cache = PromptIdsCache(max_tokens=10)
        cache.put("a", [1] * 4, 0.0)
        cache.put("b", [2] * 4, 1.0)
        cache.put("c", [3] * 4, 2.0)  # 12 > 10: "a" goes
        assert len(cache) == 2 and cache.tokens == 8
        assert cache.get("a", 2.0) is None

    def test_putting_a_key_again_replaces_its_ids(self) -> None:
        cache = PromptIdsCache()
        cache.put("a", [1] * 10, 0.0)
        cache.put("a", [2] * 3, 1.0)
        assert len(cache) == 1 and cache.tokens == 3 and cache.get("a", 1.0) == [2] * 3

    def test_many_large_bodies_hold_no_more_than_the_bound(self) -> None:
        cache = PromptIdsCache()
        ids = list(range(MAX_ENTRY_TOKENS))
        for i in range(40):
            cache.put(str(i), ids, float(i))
        assert cache.tokens <= MAX_TOKENS


class TestRule5StoredAsMachineInts:
    def test_an_entry_takes_four_bytes_an_id(self) -> None:
        cache = PromptIdsCache()
        ids = list(range(1000, 101_000))
        cache.put("a", ids, 0.0)
        (entry,) = cache._items.values()
        assert isinstance(entry.ids, array) and entry.ids.itemsize == 4
        assert sys.getsizeof(entry.ids) < 4 * len(ids) + 1000
        got = cache.get("a", 0.0)
        assert got == ids and isinstance(got, list)
        got.append(5)  # the caller's list is its own
        assert cache.get("a", 0.0) == ids


class TestKey:
    def test_what_slotwise_and_routers_change_is_not_in_the_key(self) -> None:
        body = {"messages": [{"role": "user", "content": "hi"}], "model": "m"}
        rewritten = {**body, "stream": True, "return_progress": True, "lora": [{"id": 0, "scale": 0}],
                     "max_tokens": 5, "user": "u1"}
        assert body_key("chat", "", body) == body_key("chat", "", rewritten)

    def test_what_changes_the_prompt_is(self) -> None:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        keys = {body_key("chat", "", body), body_key("completions", "", body),
                body_key("chat", "model.gguf", body),
                body_key("chat", "", {**body, "chat_template_kwargs": {"enable_thinking": True}}),
                body_key("chat", "", {"messages": [{"role": "user", "content": "hi!"}]})}
        assert len(keys) == 5
