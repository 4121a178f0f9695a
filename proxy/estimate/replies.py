"""How much of a reply held in a slot the conversation's next prompt finds cached on this server,
learned from what the server reported. Pure.

llama-server keeps a slot's reply with its prompt, so a chat's next turn, which repeats the reply,
finds it cached only as far as the chat template renders the reply as its tokens were generated:
all of it for most models, little for reasoning models (their templates drop the thinking from
earlier turns) or where the reply's text tokenizes otherwise (the testbed's random model: in
`bench day` 7 of 12 follow-ups found 24-240 tokens of their ~110-290-token reply missing; the rest
found all of it). The cache model counts a held reply at the median share found, and the prefill
policy trims a short turn whose estimate rests on a reply only where replies are found whole.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

MIN_CLAIM = 16
"""A prompt that would find fewer of a held reply's tokens than this teaches nothing (the end of
a reply, where the template's closing tokens differ from what the model generated)."""
WHOLE_SLACK = 2
"""A reply found but for this many tokens counts as found whole (a template may trim a trailing
space; the last sampled token, never computed into the cache, is not counted as held at all)."""
KEEP = 16
"""The latest observations the figures are taken from."""
MIN_SEEN = 3
WHOLE_SHARE = 0.8
"""Replies are found whole on this server when at least this share of the latest follow-ups
found theirs whole, and at least MIN_SEEN were seen."""


def held_reply(generated: int) -> int:
    """Of `generated` tokens (`predicted_n`) those a slot holds after its prompt: all but the last,
    which was sampled and never computed (counted as held, every 24-token reply of `bench day`'s
    yesterday was found at 96 %, and the next day's follow-ups were estimated ~10 tokens over what
    they computed: 62-63 new where 54 were, too many to be trimmed beside three streams)."""
    return max(0, generated - 1)


@dataclass
class ReplyReuse:
    """What the latest follow-ups found of a held reply: each the share found, and whether whole."""

    _seen: deque[tuple[float, bool]] = field(default_factory=lambda: deque(maxlen=KEEP))

    def observe(self, claimed: int, found: int) -> None:
        """A prompt that would find `claimed` tokens of a held reply found `found` of them."""
        if claimed < MIN_CLAIM:
            return
        found = max(0, min(found, claimed))
        self._seen.append((found / claimed, found >= claimed - WHOLE_SLACK))

    def adopt(self, seen: list[tuple[float, bool]]) -> None:
        """Observations kept from before a restart, oldest first, as if seen before any since."""
        self._seen = deque([*seen, *self._seen], maxlen=KEEP)

    @property
    def count(self) -> int:
        return len(self._seen)

    def share(self) -> float:
        """The median share found; all of it until something was seen (most models)."""
        return statistics.median(s for s, _ in self._seen) if self._seen else 1.0

    def found_whole(self) -> bool:
        """Whether a held reply can be counted on, to the token: False until MIN_SEEN were seen."""
        whole = sum(w for _, w in self._seen)
        return self.count >= MIN_SEEN and whole >= WHOLE_SHARE * self.count

    def guessed(self, reply: int) -> int:
        """Of `reply` held tokens an estimate counts as cached, those not to be counted on (a
        trim, the prefill policy's rule 19, is only as good as the estimate): none while replies
        are found whole, nor of a reply of under MIN_CLAIM tokens (missed, it costs a trim piece
        a few rows)."""
        return 0 if reply < MIN_CLAIM or self.found_whole() else reply

    def seen(self) -> list[tuple[float, bool]]:
        """The observations, oldest first, as `adopt` takes them back."""
        return list(self._seen)

    def summary(self) -> str:
        if not self._seen:
            return "no follow-up seen yet"
        return (f"{sum(w for _, w in self._seen)} of the latest {self.count} follow-ups found "
                f"their reply whole; median share found {self.share():.0%}")
