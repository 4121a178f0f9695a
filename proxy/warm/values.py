"""What the warm-up queue keeps and answers: a warm-up, the knobs, the decisions. Values and a little
arithmetic; the queue (`queue.py`) decides, with what the real requests are doing (`Load`) and the
piece sizes (`Sizer`) the prefill policy gives it (`proxy/prefill/events.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.config import PrefillConfig, WarmConfig
from proxy.prefill.outlook import BEHIND_SHARE
from proxy.record.outcome import Outcome


class WarmRefused(Exception):
    """A warm-up the bounds do not let in (HTTP 429); the message names the config key."""


@dataclass(frozen=True)
class WarmKnobs:
    """`[warm]` in the units the queue uses."""

    max_pending: int = 8
    max_tokens: int = 32768
    expire_s: float = 300.0
    max_per_client: int = 2
    prefill_share: float = 0.55
    """The share of time a warm-up's pieces take while others generate (the pause after each,
    as `chunk`'s): `warm_share` of the prefill policy's."""


def warm_knobs(warm: WarmConfig, prefill: PrefillConfig) -> WarmKnobs:
    """The queue's knobs from the config's `[warm]` and `[prefill]` (the warmer's, the what-if's)."""
    return WarmKnobs(max_pending=warm.max_pending, max_tokens=warm.max_tokens,
                     expire_s=warm.expire_s, max_per_client=warm.max_per_client,
                     prefill_share=warm_share(prefill.prefill_share))


def warm_share(prefill_share: float) -> float:
    """A warm-up's share while others generate: `prefill.prefill_share`, but at least BEHIND_SHARE,
    the most a cold request behind its bound gets. Its user is typing the turn that needs it: that
    work comes anyway seconds later, as a cold request that falls behind its bound, and done now
    it is done before the turn. At `chunk`'s 0.55 `bench day`'s warm-ups computed 760-1,280 of a
    post-summary prompt's ~2,000-2,400 tokens in the user's 4-8 s of typing, and the turn then
    waited 5.6-8.5 s for the rest; the streams' gap stays one piece (pieces are sized as before)."""
    return max(prefill_share, BEHIND_SHARE)


@dataclass(eq=False)
class WarmUp:
    id: str
    client: str | None
    ids: Sequence[int]
    """The prefix to compute (cut to `max_tokens` tokens after the cached part)."""
    cached: int
    """Tokens the server held already when the warm-up was asked for (the cache model)."""
    submitted: float
    capped: bool = False
    done_upto: int = -1
    piece_upto: int | None = None
    next_piece_at: float = 0.0
    pieces: int = 0
    computed: int = 0
    """Tokens the server computed for its pieces."""
    largest_piece: int | None = None
    started: float | None = None
    ended: float | None = None
    outcome: Outcome | None = None
    reason: str = ""
    ending: tuple[Outcome, str] | None = None
    """How it ends once the piece in flight is done."""
    credited: bool = False
    """A real request was credited with its work."""
    restorable: int = 0
    """Tokens beyond `cached` a kept file holds (keep_kv): restored before any piece (rule 10)."""
    restored: int = 0
    """Tokens its restore put in a slot."""
    first_upto: int = 0
    """Its first piece ends at this prefix at least (`CacheModel.first_piece_floor`, rule 11)."""

    def __post_init__(self) -> None:
        if self.done_upto < 0:
            self.done_upto = self.cached

    @property
    def to_compute(self) -> int:
        return max(0, len(self.ids) - self.cached)

    @property
    def state(self) -> str:
        if self.outcome is not None:
            return "ended"
        return "pending" if self.started is None else "running"


@dataclass(frozen=True)
class Feed:
    """Send the prefix's first `upto` ids as a piece; report `on_piece_done` or `on_piece_failed`."""

    warm_id: str
    upto: int


@dataclass(frozen=True)
class RestoreKept:
    """Restore the kept file that holds the prefix into an idle slot (keep_kv); report
    `on_restored` or `on_restore_failed`. It is in flight like a piece."""

    warm_id: str


@dataclass(frozen=True)
class Ended:
    """The warm-up ended (`outcome` is set): write its record."""

    warm_id: str


@dataclass(frozen=True)
class CancelWarmPiece:
    """Close the warm-up's piece in flight (the prefill policy's `CancelPiece` closes a request's);
    report nothing more for it."""

    warm_id: str


WarmDecision = Feed | RestoreKept | Ended | CancelWarmPiece


@dataclass(frozen=True)
class Credit:
    tokens: int = 0
    """Prompt tokens of the request that warm-ups computed."""
    warm_ids: tuple[str, ...] = ()
    largest_piece: int = 0
    """The largest piece those warm-ups computed (0: none): a size measured at this prompt's
    prefix, on this server, beside the same streams, so the request's own pieces need not ramp up
    from a small one again (the policy's `Arrived.ramp_from`)."""
