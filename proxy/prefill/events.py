"""What the prefill policy hears and what it answers: frozen values, no behaviour.

Events (past tense) are what the gate saw happen; decisions (imperative) are what the gate must do.
Every value names the request by the gate's own `req_id`; times are plain seconds from any clock.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- events --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrived:
    req_id: str
    est_new_tokens: int
    """Prompt tokens the server will have to compute (not found in its cache)."""
    est_prompt_tokens: int
    """All prompt tokens (cached + new); the plan feeds prefixes of this many ids."""
    now: float


@dataclass(frozen=True)
class PrefillStarted:
    req_id: str
    now: float


@dataclass(frozen=True)
class FirstToken:
    req_id: str
    now: float


@dataclass(frozen=True)
class Finished:
    req_id: str
    now: float
    prompt_n: int | None = None
    """The server's `timings.prompt_n` (tokens computed), if seen."""
    prompt_ms: float | None = None
    """The server's `timings.prompt_ms`, if seen."""


@dataclass(frozen=True)
class PieceDone:
    req_id: str
    tokens: int
    """Prompt tokens the piece computed (its `timings.prompt_n`)."""
    elapsed_ms: float
    """Wall time from sending the piece to its response."""
    now: float


@dataclass(frozen=True)
class PieceFailed:
    req_id: str
    reason: str
    now: float


@dataclass(frozen=True)
class ClientLeft:
    req_id: str
    now: float


@dataclass(frozen=True)
class Tick:
    now: float


Event = (Arrived | PrefillStarted | FirstToken | Finished | PieceDone | PieceFailed | ClientLeft
         | Tick)

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


Decision = Admit | Hold | FeedPiece | Forward | Reject | CancelPiece
