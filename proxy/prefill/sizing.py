"""Piece arithmetic for feeding a cold prompt in pieces: where a piece ends and the pause after it.

Pure functions. How large a piece is comes from the fitted batch cost (`batch_cost.py`,
`strategy.py`), not from here.
"""

from __future__ import annotations

PIECE_ALIGN = 64
"""Piece ends are multiples of this many tokens (also the cache model's block size)."""


def pause_s(piece_elapsed_s: float, prefill_share: float) -> float:
    """The pause after a piece that gives the prompt `prefill_share` of the time."""
    return max(0.0, piece_elapsed_s) * (1.0 - prefill_share) / prefill_share


def next_upto(done: int, piece: int, align: int = PIECE_ALIGN) -> int:
    """End of the next cumulative prefix: `done + piece` rounded down to `align` (always > done)."""
    return max(done + 1, (done + piece) // align * align)
