"""Piece arithmetic for feeding a cold prompt in pieces: where a piece ends and the pause after it.

Pure functions. How large a piece is comes from the fitted batch cost (`batch_cost.py`,
`strategy.py`), not from here.
"""

from __future__ import annotations

PIECE_ALIGN = 64
"""Piece ends are multiples of this many tokens (also the cache model's block size)."""
FIRST_PIECE_MAX = 512
"""A first piece is raised to its floor (`first_piece_end`) only up to this many tokens, and a
quarter of the prompt: a chat template's shared head (18-23 tokens in bench day) needs 256; a
longer shared system prompt would need a first piece that stalls the streams like the whole
prompt, a worse price than the slot it spares (which llama-server's RAM cache often gives back)."""


def pause_s(piece_elapsed_s: float, prefill_share: float) -> float:
    """The pause after a piece that gives the prompt `prefill_share` of the time."""
    return max(0.0, piece_elapsed_s) * (1.0 - prefill_share) / prefill_share


def next_upto(done: int, piece: int, align: int = PIECE_ALIGN) -> int:
    """End of the next cumulative prefix: `done + piece` rounded down to `align` (always > done)."""
    return max(done + 1, (done + piece) // align * align)


def first_piece_end(upto: int, floor: int, total: int) -> int:
    """Where a first piece that would end at `upto` ends: at `floor` rounded up to a multiple of
    PIECE_ALIGN (within `total`) when it would end short of it, and the floor is within
    FIRST_PIECE_MAX and a quarter of `total`; else at `upto`. `floor`: the shortest prefix
    llama-server would not place by its similarity into another prompt's slot
    (`CacheModel.first_piece_floor`)."""
    if upto >= floor or floor > min(FIRST_PIECE_MAX, total // 4):
        return upto
    return min(total, -(-floor // PIECE_ALIGN) * PIECE_ALIGN)
