"""llama-server's RAM prompt cache (`--cache-ram`, `server_prompt_cache` in tools/server/server-task.cpp),
on sequences without text: entries in insertion order, a byte limit, oldest evicted first.

`save` copies a slot's tokens in (skipped when an entry holds them already; entries the new one
holds are dropped); `load` takes out the entry that keeps at least a quarter of itself and beats the
slot's own content on both the share of the entry kept and the share of the prompt found. Pure.
"""

from __future__ import annotations

from proxy.whatif.prompts import Held, Seq

MIN_KEEP = 0.25
"""An entry is restored only if the new prompt keeps at least this share of it."""


class PromptCache:
    def __init__(self, limit_mib: int, bytes_per_token: float) -> None:
        self.enabled = limit_mib != 0
        self._limit = None if limit_mib < 0 else limit_mib * 1024.0 * 1024.0
        self._bpt = max(1.0, bytes_per_token)
        self.entries: list[Held] = []

    def save(self, held: Held) -> int:
        """Copy `held` in; returns the tokens copied (0: skipped)."""
        if not self.enabled or held.n <= 0:
            return 0
        if any(entry.contains(held) for entry in self.entries):
            return 0
        size = held.n * self._bpt
        if self._limit is not None and size > self._limit:
            return 0
        self.entries = [e for e in self.entries if not held.contains(e)]
        if self._limit is not None:
            while self.entries and self._bytes() + size > self._limit:
                self.entries.pop(0)
        self.entries.append(Held(held.seq, held.n))
        return held.n

    def load(self, current: Held, prompt: Seq) -> Held | None:
        """The entry to restore into a slot holding `current` for `prompt` (taken out), or None."""
        if not self.enabled or not self.entries or prompt.length <= 0:
            return None
        common = current.common(prompt)
        keep_best = common / current.n if current.n > 0 else -1.0
        sim_best = common / prompt.length
        best: Held | None = None
        for entry in self.entries:
            found = entry.common(prompt)
            keep, sim = found / entry.n, found / prompt.length
            if keep >= MIN_KEEP and keep > keep_best and sim > sim_best:
                keep_best, sim_best, best = keep, sim, entry
        if best is not None:
            self.entries.remove(best)
        return best

    def common(self, prompt: Seq) -> int:
        """The most tokens of `prompt` an entry holds."""
        return max((e.common(prompt) for e in self.entries), default=0)

    def _bytes(self) -> float:
        return sum(e.n for e in self.entries) * self._bpt
