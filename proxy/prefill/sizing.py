"""Piece arithmetic for feeding a cold prompt in pieces: where a piece ends and the pause after it.

Pure functions. How large a piece is comes from the fitted batch cost (`batch_cost.py`,
`strategy.py`), not from here.
"""

from __future__ import annotations

PIECE_ALIGN = 64
"""Piece ends are multiples of this many tokens (also the cache model's block size)."""
TILE_ROWS = 64
"""Rows of queries ggml's CPU flash attention computes together (ggml-cpu/ops.cpp,
flash_attn_ext_tiled). A micro-batch of fewer rows is computed one row at a time, each row reading
its whole context: `slotwise bench pieces` beside two streams, after 5,000 tokens, 48 tokens took
1.22 s and 64 took 0.28 s; after 15,000, 3.64 s and 0.78 s."""
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


def absorb_tail(upto: int, total: int, leave: int) -> int:
    """Where a piece that would end at `upto` of `total` tokens ends so that what it leaves is no
    batch of under TILE_ROWS tokens: such a rest is taken into the piece, all but `leave` tokens
    (a cold request's real request computes at least one, to answer: one row costs what a decode
    token does; 47 tokens left after a `bench day` turn's last piece took 733 ms beside three
    streams, a 64-token piece there ~250 ms)."""
    if 0 < total - upto < TILE_ROWS:
        return max(upto, total - leave)
    return upto


def first_piece_end(upto: int, floor: int, total: int) -> int:
    """Where a first piece that would end at `upto` ends: at `floor` rounded up to a multiple of
    PIECE_ALIGN (within `total`) when it would end short of it, and the floor is within
    FIRST_PIECE_MAX and a quarter of `total`; else at `upto`. `floor`: the shortest prefix
    llama-server would not place by its similarity into another prompt's slot
    (`CacheModel.first_piece_floor`; bench day: `bob-0`'s 128-token first piece, 23 tokens shared,
    took `ann-0`'s slot, and ann's 1,998 tokens cost 2,496-2,624 computed)."""
    if upto >= floor or floor > min(FIRST_PIECE_MAX, total // 4):
        return upto
    return min(total, -(-floor // PIECE_ALIGN) * PIECE_ALIGN)
