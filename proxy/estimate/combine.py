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

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.new_tokens


def estimate(ids: Sequence[int], cache: CacheModel | None = None) -> Estimate:
    """Without a cache model every token counts as new (the safe side: more requests are cold)."""
    cached = cache.estimate_cached(ids) if cache is not None else 0
    return Estimate(prompt_tokens=len(ids), new_tokens=len(ids) - cached)
