"""A model of what llama-server holds in its prompt cache, learned from the prompts slotwise sent.

Each entry is one slot's prompt, with the chain of its block hashes (a block hash names the whole
prefix up to it) to match long prompts fast; bounded by the slot count and context. Pure: no I/O;
the server's `cache_n` corrects it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 64
SLOT_SIMILARITY = 0.1
"""llama-server's `--slot-prompt-similarity` default: a prompt goes to the slot it shares the
longest prefix with only if that prefix is more than this share of the prompt."""


def block_hashes(ids: Sequence[int], block: int = BLOCK_TOKENS) -> list[int]:
    """Chained hashes of the full blocks of `ids`: equal at index k means equal prefixes of
    (k + 1) * block tokens (a trailing partial block is not hashed)."""
    out: list[int] = []
    previous = 0
    for start in range(0, len(ids) - block + 1, block):
        previous = hash((previous, tuple(ids[start:start + block])))
        out.append(previous)
    return out


def common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading equal hashes of two chains; chaining makes equality monotone, so bisect."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Entry:
    """One slot as modelled: its prompt's tokens, and their block chain for fast matching."""

    ids: list[int]
    chain: list[int]

    def common(self, ids: Sequence[int], chain: list[int], block: int) -> int:
        """Tokens this entry shares with `ids` from the start: whole blocks by their hashes,
        then token by token inside the first block that differs."""
        start = common_blocks(self.chain, chain) * block
        extra = 0
        for mine, theirs in zip(self.ids[start:start + block], ids[start:start + block],
                                strict=False):
            if mine != theirs:
                break
            extra += 1
        return start + extra

    def cut(self, tokens: int, block: int) -> None:
        self.ids, self.chain = self.ids[:tokens], self.chain[:tokens // block]


class CacheModel:
    """The server's slots as an LRU of prompts.

    `estimate_cached(ids)` is the longest cached prefix, to the token (at most len(ids) - 1, since
    the server always recomputes one token). `record(ids, cache_n)` is called after each request or
    piece with the prompt it sent: the entry sharing the longest prefix with it (the slot the server
    most likely chose) takes the new prompt, otherwise the least recently used entry makes room. If
    the server reports less cached than predicted, the entries that claimed more are cut back to what
    the server said (trust the server).
    """

    def __init__(self, n_slots: int, n_ctx: int, *, block: int = BLOCK_TOKENS,
                 max_total_tokens: int | None = None) -> None:
        if n_slots < 1 or n_ctx < 1 or block < 1:
            raise ValueError(f"need n_slots, n_ctx, block >= 1, got {n_slots}, {n_ctx}, {block}")
        self._n_slots = n_slots
        self._n_ctx = n_ctx
        self._block = block
        self._max_total = max_total_tokens
        self._entries: list[_Entry] = []  # least recently used first

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        """Tokens modelled per entry, least recently used first (for a status page)."""
        return tuple(len(e.ids) for e in self._entries)

    def estimate_cached(self, ids: Sequence[int]) -> int:
        return self._cached(ids, block_hashes(ids, self._block))

    def record(self, ids: Sequence[int], cache_n_reported: int | None = None) -> None:
        ids = list(ids[:self._n_ctx])
        chain = block_hashes(ids, self._block)
        if cache_n_reported is not None and cache_n_reported < self._cached(ids, chain):
            self._cut_back(ids, chain, cache_n_reported)
        best = self._best_match(ids, chain)
        if best is not None:
            del self._entries[best]
        self._entries.append(_Entry(ids, chain))
        self._evict()

    def forget(self, chain: Sequence[int]) -> None:
        """A conversation left the server (a restore took its slot): the entries holding most of
        its block chain go."""
        blocks = list(chain)
        self._entries = [e for e in self._entries
                         if 2 * common_blocks(e.chain, blocks) < max(1, len(blocks))]

    def clear(self) -> None:
        """Forget everything (the server restarted, or its caches were erased)."""
        self._entries.clear()

    def _shared(self, ids: Sequence[int], chain: list[int]) -> list[int]:
        return [e.common(ids, chain, self._block) for e in self._entries]

    def _cached(self, ids: Sequence[int], chain: list[int]) -> int:
        return max(0, min(max(self._shared(ids, chain), default=0), len(ids) - 1))

    def _cut_back(self, ids: Sequence[int], chain: list[int], cache_n: int) -> None:
        keep = max(0, cache_n)
        for entry, shared in zip(self._entries, self._shared(ids, chain), strict=True):
            if shared > keep:
                entry.cut(keep, self._block)
        self._entries = [e for e in self._entries if e.ids]

    def _best_match(self, ids: Sequence[int], chain: list[int]) -> int | None:
        """The entry the server would put this prompt in: the longest shared prefix, if it is more
        than SLOT_SIMILARITY of the prompt (else the server takes its least recently used slot)."""
        shared = self._shared(ids, chain)
        if not shared or max(shared) <= SLOT_SIMILARITY * len(ids):
            return None
        return shared.index(max(shared))

    def _evict(self) -> None:
        while len(self._entries) > self._n_slots or self._over_total():
            self._entries.pop(0)

    def _over_total(self) -> bool:
        if self._max_total is None or len(self._entries) <= 1:
            return False
        return sum(len(e.ids) for e in self._entries) > self._max_total
