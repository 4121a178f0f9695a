"""The prompt ids of the last bodies tokenized, by a hash of the body: a small LRU with an age limit.

A router that renders a request on every node (`/v1/chat/completions/render`) and then sends the
same body to one of them would have that node tokenize it twice; with this cache the second time is
a lookup. Pure: the caller passes the time in. The key leaves out the fields that never change the
prompt and that slotwise or the router add or rewrite between the two (`stream`, `return_progress`,
`lora`, ...), so the render and the real request find each other.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

NOT_PROMPT_FIELDS = frozenset({
    "stream", "stream_options", "return_progress", "lora", "n_predict", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "id_slot",
    "cache_prompt", "logprobs", "top_logprobs", "n_probs", "timings_per_token", "user",
})
"""Body fields that are sampling or transport settings: they never reach the chat template or the
tokenizer, so two bodies that differ only in them have the same prompt ids."""

DEFAULT_ENTRIES = 256
DEFAULT_MAX_AGE_S = 120.0
"""An entry older than this is not used: a restarted llama-server may serve another model."""


def body_key(kind: str, tokenizer: str, body: Mapping[str, Any]) -> str:
    """The cache key of a request body: its kind, the tokenizer in use and every field that can
    change the prompt, in a canonical encoding (sorted keys)."""
    prompt_part = {k: v for k, v in body.items() if k not in NOT_PROMPT_FIELDS}
    try:
        encoded = orjson.dumps(prompt_part, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except TypeError:  # not JSON data: never equal to another body
        encoded = repr(prompt_part).encode()
    digest = hashlib.blake2b(encoded, digest_size=16)
    digest.update(f"\0{kind}\0{tokenizer}".encode())
    return digest.hexdigest()


@dataclass
class CacheCounts:
    hits: int = 0
    misses: int = 0


class PromptIdsCache:
    """`get(key, now)` the ids stored for a key (None if absent or too old); `put(key, ids, now)`.

    At most `entries` keys, the least recently used dropped first."""

    def __init__(self, entries: int = DEFAULT_ENTRIES, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        if entries < 1:
            raise ValueError(f"a prompt ids cache needs at least one entry, got {entries}")
        self.entries = entries
        self.max_age_s = max_age_s
        self.counts = CacheCounts()
        self._items: OrderedDict[str, tuple[float, tuple[int, ...]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str, now: float) -> list[int] | None:
        item = self._items.get(key)
        if item is None or now - item[0] > self.max_age_s:
            if item is not None:
                del self._items[key]
            self.counts.misses += 1
            return None
        self._items.move_to_end(key)
        self.counts.hits += 1
        return list(item[1])

    def put(self, key: str, ids: list[int], now: float) -> None:
        self._items[key] = (now, tuple(ids))
        self._items.move_to_end(key)
        while len(self._items) > self.entries:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()
