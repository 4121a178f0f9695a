"""The estimate the prefill policy needs: all prompt tokens, and those the server must compute.

Pure: the prompt's ids (from a tokenizer) and the cache model in, an `Estimate` out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.estimate.cache_model import CacheModel


@dataclass(frozen=True)
class Estimate:
    prompt_tokens: int
    """All tokens of the prompt (what the server reports as prompt_n + cache_n)."""
    new_tokens: int
    """Tokens the server is expected to compute (not found in its cache)."""
    guessed_tokens: int = 0
    """Of the cached tokens, those of a held reply while this server has not shown that follow-ups
    find their reply whole (`ReplyReuse.found_whole`): they may have to be computed after all."""

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.new_tokens


def estimate(ids: Sequence[int], cache: CacheModel | None = None) -> Estimate:
    """Without a cache model every token counts as new (the safe side: more requests are cold)."""
    if cache is None:
        return Estimate(prompt_tokens=len(ids), new_tokens=len(ids))
    cached, reply = cache.estimate_parts(ids)
    return Estimate(prompt_tokens=len(ids), new_tokens=len(ids) - cached,
                    guessed_tokens=cache.replies.guessed(reply))
