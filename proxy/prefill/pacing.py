"""How fast cold requests and warm-ups are fed, beside the piece size the strategy chooses: the share
of time a cold request's pieces get (rule 6, under `max_cold_factor`), what happens when nobody
generates (rule 7), and how large a warm-up's piece is (rule 15).

Pure functions of the fitted batch cost, the config and the held request; the policy calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.config import PrefillConfig
from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.events import Load
from proxy.prefill.held import HeldRequest
from proxy.prefill.outlook import ChunkKnobs, Situation, fitting_piece, piece_sizes, ramp_cap
from proxy.prefill.sizing import PIECE_ALIGN
from proxy.prefill.strategy import Strategy, choose_piece

IDLE_WHOLE = 4.0
"""Rule 7: with nobody generating, a rest predicted under this × `max_stall_ms` is forwarded whole."""
IDLE_STALL = 4.0
"""Rule 7: otherwise its pieces fill up to this × `max_stall_ms`, back to back."""


def idle_piece(cost: BatchCost, cfg: PrefillConfig, n_batch: int, held: HeldRequest,
               rest: int) -> int | None:
    """Rule 7: nobody generates. None: the rest is short, or no larger than the piece (one more
    piece would be all of it), forward it whole; else the next piece, up to IDLE_STALL ×
    `max_stall_ms` (back to back, so somebody who comes back meanwhile, a chat user's next turn,
    waits for one piece, not for the whole rest). On a machine seen slow no size fits, and the
    smallest goes: the one token a last piece leaves (rule 18) got a 64-token piece past the
    prompt's end, and the feeder failed it (the suite's real-server test under load)."""
    if cost.prompt_ms(rest, held.done_upto, n_batch) <= IDLE_WHOLE * cfg.max_stall_ms:
        return None
    cap = ramp_cap(n_batch, held.largest_piece)
    budget = IDLE_STALL * cfg.max_stall_ms
    fits = [n for n in piece_sizes(cap) if cost.batch_ms(n, held.done_upto) <= budget]
    piece = max(fits, default=PIECE_ALIGN)
    return None if rest <= piece else piece


def bound_need(cost: BatchCost, cfg: PrefillConfig, n_batch: int, held: HeldRequest,
               decoders: int, now: float, cells: int = 0) -> tuple[float, float]:
    """Rule 6: a plan's rest, priced in pieces of its largest so far, and the time it has left
    within `max_cold_factor` × its time alone (ms). Its pieces get `prefill_share` of the time,
    or more when it would otherwise take longer than that (`bound_share`): the pauses shrink to
    what keeps it within it, down to none."""
    req = held.req
    rest = req.est_prompt_tokens - held.done_upto
    piece = max(PIECE_ALIGN, held.largest_piece or PIECE_ALIGN)
    rest_ms = cost.prompt_ms(rest, held.done_upto, piece, decoders, cells)
    left_ms = cfg.max_cold_factor * held.alone_ms(cost, n_batch) - (now - req.now) * 1000.0
    return rest_ms, left_ms


def bound_share(needs: Sequence[tuple[float, float]], floor: float) -> float:
    """The share of time pieces need so that every plan (`bound_need`'s rest and time left) meets
    its bound, the soonest bound served first: at each bound, every rest due by then over the time
    left until it; at least `floor`, at most 1.0 (1.0: some plan cannot, it is behind)."""
    share, due = floor, 0.0
    for rest_ms, left_ms in sorted(needs, key=lambda need: need[1]):
        due += rest_ms
        if left_ms <= due:
            return 1.0
        share = max(share, due / left_ms)
    return min(1.0, share)


@dataclass(frozen=True)
class WarmSizer:
    """Rule 15: a warm-up's next piece, from the policy's batch cost. While others generate it is
    the piece the strategy would choose for a cold request at the same prefix (`choose_piece`):
    the fitting piece while pieces keep the streams' promise, larger ones when the fixed part eats
    small pieces (bench day, four streams on one shared KV: 64-token pieces took ~0.7 s, and a
    warm-up made 249 of a post-summary prompt's 2,428 tokens in the 4 s its user typed); the
    fitting piece when the strategy would hold. On an idle server only a real request that
    arrives during a piece waits for the rest of its batch, so pieces of IDLE_STALL ×
    `max_stall_ms` keep that wait at about one piece while using the server better than small
    ones (fewer fixed parts)."""

    cost: BatchCost
    max_stall_ms: float
    n_batch: int
    prefill_share: float

    def limit_ms(self, load: Load) -> float:
        return self.max_stall_ms * (1.0 if load.busy else IDLE_STALL)

    def piece(self, done: int, remaining: int, largest: int | None, load: Load) -> int:
        situation = Situation(done_tokens=done, remaining_tokens=remaining, decoders=load.decoders,
                              cells=load.cells, largest_piece=largest)
        knobs = ChunkKnobs(max_stall_ms=self.limit_ms(load), n_batch=self.n_batch,
                           prefill_share=self.prefill_share, max_hold_ms=0.0)
        if not load.busy:
            return fitting_piece(self.cost, situation, knobs)
        choice = choose_piece(self.cost, situation, knobs)
        if choice.strategy is Strategy.WHOLE:
            return remaining
        if choice.strategy is Strategy.HOLD:
            return fitting_piece(self.cost, situation, knobs)
        return choice.piece_tokens
