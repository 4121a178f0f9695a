"""Read-only values describing the prefill policy's state, for a status page.

Built by `PrefillPolicy.snapshot()`; nothing here changes the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Phase(StrEnum):
    """Where a request that was sent upstream is; all of them count as generating (or about to)."""

    SENT = "sent"
    PREFILLING = "prefilling"
    DECODING = "decoding"


@dataclass(frozen=True)
class ChunkProgress:
    req_id: str
    done_tokens: int
    total_tokens: int
    pieces_done: int
    piece_in_flight_upto: int | None
    next_piece_at: float | None


@dataclass(frozen=True)
class PolicySnapshot:
    """Read-only view for a status page."""

    mode: str
    held: tuple[str, ...]
    """Cold requests kept in the proxy: the active one (defer or chunk) first, then the waiting."""
    waiting: tuple[str, ...]
    """Cold requests waiting for their turn, in arrival order."""
    chunking: ChunkProgress | None
    in_flight: tuple[tuple[str, Phase], ...]
    prefill_tps: float
    rate_samples: int
    piece_tokens: int
