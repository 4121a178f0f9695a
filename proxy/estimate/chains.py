"""Prompts as chains of block hashes (a block hash names the whole prefix up to it), and one cached
prompt, a slot's or the RAM cache's, with the reply the server generated after it: how much of
another prompt it holds. Pure; the cache model (cache_model.py) keeps these entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BLOCK_TOKENS = 64


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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading equal token ids of two prompts."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Entry:
    """One slot as modelled: its prompt's tokens, and their block chain for fast matching."""

    ids: list[int]
    chain: list[int]
    generated: int = 0
    """Tokens the server generated after `ids` and holds with them (a reply; their ids are not
    known here): a prompt that shares all of `ids` finds up to that many more cached, since a
    chat's next turn repeats the reply (`bench day`: follow-ups estimated at 166-352 new tokens
    computed 50-58), as far as its template renders the reply as generated (replies.py)."""

    def common(self, ids: Sequence[int], chain: list[int], block: int,
               reply_share: float = 1.0) -> int:
        """Tokens this entry shares with `ids` from the start: its prompt's, then its generated
        tokens at `reply_share` (`parts`)."""
        prompt, reply = self.parts(ids, chain, block)
        return prompt + round(reply * reply_share)

    def parts(self, ids: Sequence[int], chain: list[int], block: int) -> tuple[int, int]:
        """Tokens of its prompt this entry shares with `ids` from the start (whole blocks by their
        hashes, then token by token inside the first block that differs); and, past all of its
        prompt, how many of its generated tokens `ids` would find if the reply is found whole."""
        start = common_blocks(self.chain, chain) * block
        shared = start + common_prefix(self.ids[start:start + block], ids[start:start + block])
        if shared == len(self.ids) and self.generated:
            return shared, max(0, min(self.generated, len(ids) - shared))
        return shared, 0

    def cut(self, tokens: int, block: int) -> None:
        if tokens >= len(self.ids):  # the server kept its prompt and part of the reply
            self.generated = min(self.generated, tokens - len(self.ids))
            return
        self.ids, self.chain, self.generated = self.ids[:tokens], self.chain[:tokens // block], 0
