"""The prompt ids of the last bodies tokenized, by a hash of the body: bounded in entries, in ids
held (in all and per entry) and in age.

A router that renders a request on every node (`/v1/chat/completions/render`) and then sends the
same body to one of them would have that node tokenize it twice; with this cache the second time is
a lookup. Any client that may render fills it, so all it holds is bounded and compact (issue 20: ten
renders of 8 MB bodies once kept 800 MB here). Pure: the caller passes the time in. The key leaves
out the fields that never change the prompt and that slotwise or the router add or rewrite between
the two (`stream`, `return_progress`, `lora`, ...), so the render and the real request find each other.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
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
"""Bodies held at most: a router's render and its request come about a second apart, so a node needs
a few entries per request in flight."""
DEFAULT_MAX_AGE_S = 120.0
"""An entry older than this is not used: a restarted llama-server may serve another model."""
MAX_TOKENS = 1 << 22
"""Ids held by all entries together: 4,194,304 (16 MiB as 4-byte ids), 128 prompts of 32k tokens,
more than a node renders in the seconds between a render and its request. It is also the most any
client can make this cache hold."""
MAX_ENTRY_TOKENS = 1 << 18
"""A prompt of more ids is never stored: 262,144, more than one slot of the models llama.cpp serves
holds (128k to 256k contexts), so only prompts no slot can take are left out. The caller passes a
tighter cap when it knows one slot's context (`put(..., limit=)`): a longer prompt is refused by the
server, so its ids would never be asked for again."""
ID_TYPE = "i"
"""`array` type code of a stored id: a C int, as llama.cpp's `llama_token` (int32)."""


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


@dataclass(frozen=True)
class _Entry:
    put_at: float
    ids: array[int]


class PromptIdsCache:
    """`get(key, now)` the ids stored for a key, or None; `put(key, ids, now, limit=None)`.

    Rules (tests/test_ids_cache.py follows them one to one):
     1. `get` answers a copy of the ids `put` stored under the key and counts a hit; else None and a
        miss.
     2. An entry is used for `max_age_s` after it was put; every `get` and `put` first drops the
        entries older than that, so none outlives its age by more than the next access.
     3. A prompt of more than `max_entry_tokens` ids, or more than the `limit` the caller passes
        (one slot's context), is not stored, nor one with an id outside 32 bits; an older entry
        under its key is dropped.
     4. At most `entries` entries and `max_tokens` ids in all: the oldest go first.
     5. Ids are held as 4-byte machine ints (`array('i')`), not as Python ints (32 bytes each and
        an 8-byte pointer).
    """

    def __init__(self, entries: int = DEFAULT_ENTRIES, max_age_s: float = DEFAULT_MAX_AGE_S, *,
                 max_tokens: int = MAX_TOKENS, max_entry_tokens: int = MAX_ENTRY_TOKENS) -> None:
        if entries < 1 or max_tokens < 1 or max_entry_tokens < 1:
            raise ValueError("a prompt ids cache needs room for one entry of one id, got "
                             f"entries={entries}, max_tokens={max_tokens}, "
                             f"max_entry_tokens={max_entry_tokens}")
        self.entries = entries
        self.max_age_s = max_age_s
        self.max_tokens = max_tokens
        self.max_entry_tokens = min(max_entry_tokens, max_tokens)
        self.counts = CacheCounts()
        self.tokens = 0
        """Ids held now, in all entries (the metrics)."""
        self._items: OrderedDict[str, _Entry] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str, now: float) -> list[int] | None:
        self.expire(now)
        entry = self._items.get(key)
        if entry is None:
            self.counts.misses += 1
            return None
        self.counts.hits += 1
        return entry.ids.tolist()

    def put(self, key: str, ids: Sequence[int], now: float, limit: int | None = None) -> bool:
        """Store `ids` under `key`; False when rule 3 leaves them out."""
        self.expire(now)
        self._drop(key)
        cap = self.max_entry_tokens if limit is None else min(limit, self.max_entry_tokens)
        if len(ids) > cap:
            return False
        try:
            packed = array(ID_TYPE, ids)
        except (OverflowError, TypeError):
            return False
        self._items[key] = _Entry(now, packed)
        self.tokens += len(packed)
        while len(self._items) > self.entries or self.tokens > self.max_tokens:
            self._drop(next(iter(self._items)))
        return True

    def expire(self, now: float) -> None:
        """Drop the entries older than `max_age_s` (the oldest are first)."""
        while self._items:
            key, entry = next(iter(self._items.items()))
            if now - entry.put_at <= self.max_age_s:
                return
            self._drop(key)

    def clear(self) -> None:
        self._items.clear()
        self.tokens = 0

    def _drop(self, key: str) -> None:
        entry = self._items.pop(key, None)
        if entry is not None:
            self.tokens -= len(entry.ids)
