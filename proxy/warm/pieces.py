"""One warm-up's pieces: whether the next may start now, where it ends, and what one done leaves
(the warm-up queue's rules 5, 6, 11 and 12). Pure arithmetic over a `WarmUp`; the queue
(`queue.py`) chooses the warm-up, the size comes from the policy's `Sizer`, the ends from the
prefill's piece arithmetic (`proxy/prefill/sizing.py`).
"""

from __future__ import annotations

from proxy.prefill.events import Load, Sizer
from proxy.prefill.sizing import absorb_tail, first_piece_end, next_upto, pause_s
from proxy.warm.values import WarmUp


def may_start(warm: WarmUp, load: Load, now: float) -> bool:
    """Rules 5 and 6: not while a real cold request is held or fed, nor just after a real request
    was sent, nor while every slot is taken; while others generate, not before its pause is over."""
    return not (load.cold_held or load.starting or load.no_slot
                or (load.busy and now < warm.next_piece_at))


def piece_end(warm: WarmUp, sizer: Sizer, load: Load) -> int:
    """Where its next piece ends: the Sizer's size (rule 6), its first piece at `first_upto` at
    least (rule 11), no piece leaving fewer than TILE_ROWS tokens after it (rule 12)."""
    remaining = len(warm.ids) - warm.done_upto
    piece = max(1, sizer.piece(warm.done_upto, remaining, warm.largest_piece, load))
    end = len(warm.ids)
    upto = end if warm.done_upto + piece >= end else next_upto(warm.done_upto, piece)
    if warm.pieces == 0 and not warm.restored:  # rule 11
        upto = first_piece_end(upto, warm.first_upto, end)
    return absorb_tail(upto, end, leave=0)  # rule 12


def piece_done(warm: WarmUp, upto: int, computed: int, batch_ms: float, prefill_share: float,
               now: float) -> None:
    """Its piece in flight, to `upto`, is done: the server holds the prefix that far, and the next
    piece waits its pause (rule 6)."""
    warm.largest_piece = max(warm.largest_piece or 0, upto - warm.done_upto)
    warm.done_upto, warm.piece_upto = upto, None
    warm.pieces += 1
    warm.computed += max(0, computed)
    warm.next_piece_at = now + pause_s(batch_ms / 1000.0, prefill_share)
