"""Prompts without their text: each one a chain of segments, so that the tokens two prompts share
(what llama-server reuses from a slot or its RAM cache) can be computed from the log alone.

A segment is a run of tokens with an id of its own. A prompt that reused `c` tokens of an earlier
request's prompt and reply is that sequence cut at `c`, plus a segment of its new tokens; its reply
adds one more. Pure values; `lcp` is llama-server's `get_common_prefix` on them.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

Segment = tuple[int, int]
"""(segment id, tokens)."""


@dataclass(frozen=True, slots=True)
class Seq:
    """A token sequence: its segments in order and its length."""

    segs: tuple[Segment, ...] = ()
    length: int = 0

    def prefix(self, n: int) -> Seq:
        """The first `n` tokens (all of them if `n` is longer)."""
        if n >= self.length:
            return self
        out: list[Segment] = []
        left = max(0, n)
        for sid, size in self.segs:
            if left <= 0:
                break
            out.append((sid, min(size, left)))
            left -= size
        return Seq(tuple(out), max(0, n))

    def extend(self, sid: int, n: int) -> Seq:
        """These tokens, then `n` new ones (segment `sid`)."""
        if n <= 0:
            return self
        return Seq((*self.segs, (sid, n)), self.length + n)


EMPTY = Seq()

SEGMENT_SPAN = 1 << 24
"""Token ids per segment in `token_ids` (a segment is never this long)."""


def token_ids(seq: Seq) -> array[int]:
    """Made-up token ids for `seq` that two sequences share exactly where `lcp` says they do: for
    code that compares real ids (the warm-up queue's conversations)."""
    ids = array("l")
    for sid, size in seq.segs:
        base = sid * SEGMENT_SPAN
        ids.extend(range(base, base + size))
    return ids


def lcp(a: Seq, b: Seq) -> int:
    """The tokens `a` and `b` share from the start."""
    n = 0
    for (sa, la), (sb, lb) in zip(a.segs, b.segs, strict=False):
        if sa != sb:
            break
        if la != lb:
            return n + min(la, lb)
        n += la
    return n


@dataclass(slots=True)
class Held:
    """What a slot (or a RAM-cache entry) holds: the first `n` tokens of `seq`."""

    seq: Seq = EMPTY
    n: int = 0

    def common(self, prompt: Seq) -> int:
        return min(self.n, lcp(self.seq, prompt))

    def contains(self, other: Held) -> bool:
        """Every token of `other` is a prefix of this."""
        return other.n <= self.n and min(other.n, lcp(self.seq, other.seq)) == other.n


class SegmentIds:
    """Hands out segment ids; one per replay, so ids never collide."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self) -> int:
        self._next += 1
        return self._next
