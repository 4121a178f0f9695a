"""Read-only values describing the prefill policy's state, for a status page.

Built by `PrefillPolicy.snapshot()`; nothing here changes the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.prefill.cost_fit import CostFit
from proxy.prefill.strategy import PieceChoice
from proxy.record.flight import Phase


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
    cost: CostFit
    """The fitted batch-cost model and how well it fits."""
    choice: PieceChoice | None
    """How the active cold request goes on (chunk), as last decided."""
