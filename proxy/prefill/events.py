"""What the prefill policy keeps of a cold request, and what it answers: frozen values, no behaviour.

The gate tells the policy what happened through its `on_*` methods (past tense: arrived, prefill
started, piece done); decisions (imperative) are what the gate must do. Every value names the request
by the gate's own `req_id`; times are plain seconds from any clock.
The warm-up queue gets what the real requests are doing from the policy as a `Load`, and its piece
sizes from a `Sizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# ---- a request as it arrived -------------------------------------------------------------------


@dataclass(frozen=True)
class Arrived:
    req_id: str
    est_new_tokens: int
    """Prompt tokens the server will have to compute (not found in its cache)."""
    est_prompt_tokens: int
    """All prompt tokens (cached + new); the plan feeds prefixes of this many ids."""
    now: float
    first_upto: int = 0
    """A first piece ends at this prefix at least: a shorter one llama-server would place by its
    similarity into another prompt's slot (`CacheModel.first_piece_floor`); 0: no such risk."""
    background: bool = False
    """Its purpose is a background job's (`prefill.background_purposes`): cold by a smaller stall
    while slots are to spare (rule 1), after the chat turns for a freed slot (rule 12)."""
    guessed_tokens: int = 0
    """Of its cached tokens, those of a held reply this server has not shown to find whole
    (`Estimate.guessed_tokens`): a trim (rule 19) is only as good as the estimate."""
    ramp_from: int = 0
    """The largest piece a warm-up of its conversation computed of its prompt (0: none): its own
    pieces ramp up from there as from one of their own (rule 15; bench day: `ann-5`'s rest after
    her warm-up's pieces of 512-640 tokens went in pieces of 64, 128 and 256, 3.2 s to her first
    token)."""


@dataclass(frozen=True)
class Restorable:
    """What a kept file (keep_kv) could spare a request that arrived: the prompt tokens it holds
    beyond what the server's cache does, what restoring it costs, and how long the operator lets a
    request wait for a slot to restore it into."""

    tokens: int
    restore_ms: float
    max_wait_s: float


# ---- decisions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admit:
    """Send the request upstream now, as it came (no pieces were fed)."""

    req_id: str
    reason: str


@dataclass(frozen=True)
class Hold:
    """Keep the request in the proxy; a later decision releases, feeds or rejects it."""

    req_id: str
    reason: str


@dataclass(frozen=True)
class FeedPiece:
    """Send the prompt's first `upto_tokens` ids to `/completion` with `n_predict: 0`, then report
    `PieceDone` or `PieceFailed`. Pieces are cumulative prefixes: each one extends the last."""

    req_id: str
    upto_tokens: int
    trim: bool = False
    """Rule 19: a prefix shorter than what the server holds of the prompt (it keeps only that
    much, computing one token again), not the next of a cold prompt's pieces."""


@dataclass(frozen=True)
class Restore:
    """Restore the request's kept file into a free slot now (a slot is counted for it until
    `on_restored` or `on_restore_failed`)."""

    req_id: str


@dataclass(frozen=True)
class Save:
    """Save a slot's KV to a file now (keep_kv): the server is quiet, and the save counts as its
    user until `on_save_done`."""

    req_id: str


@dataclass(frozen=True)
class Forward:
    """Send the real request now (after pieces, or failing open); `reason` goes into its record."""

    req_id: str
    reason: str


@dataclass(frozen=True)
class Reject:
    """Answer the client with an error (HTTP 503) and do not send the request."""

    req_id: str
    reason: str


@dataclass(frozen=True)
class CancelPiece:
    """Close the in-flight piece's upstream connection; report nothing more for it."""

    req_id: str


Decision = Admit | Hold | FeedPiece | Restore | Save | Forward | Reject | CancelPiece


# ---- what the policy gives the warm-ups (rule 15) ------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What the real requests are doing now, as far as a warm-up cares."""

    cold_held: bool = False
    """A real cold request is held or fed in pieces by the prefill policy."""
    starting: bool = False
    """A real request was sent upstream a moment ago and its prompt is about to start (it starts
    alone), or a save runs on the server's main loop: no piece now."""
    busy: bool = False
    """Real requests are in flight upstream (generating)."""
    no_slot: bool = False
    """Every slot of llama-server is taken (the policy's rule 12 counts them): a piece sent now
    would wait in the server's queue and then take the next slot to come free, before the
    requests held for one (bench day: `ann`'s warm-up piece sent as a held turn took the last
    slot, waited 4.8 s in llama-server's queue)."""
    decoders: int = 0
    cells: int = 0
    """Cells the requests in flight hold (their prompts), for the batch cost."""
    recheck_at: float | None = None
    """When `starting` may end with no event to say so (a just-sent request's grace)."""


class Sizer(Protocol):
    """How large a warm-up's next piece may be under a `Load` (the policy's pacing)."""

    def piece(self, done: int, remaining: int, largest: int | None, load: Load) -> int:
        """Tokens of the next piece after `done` cached, `remaining` to go."""
        ...
