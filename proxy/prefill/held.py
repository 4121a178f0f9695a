"""A cold request the policy is holding or feeding (its plan): how far its pieces got, and how its
release is worded. Pure data with a little arithmetic; the policy decides."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.events import Admit, Arrived, Forward
from proxy.prefill.sizing import absorb_tail, first_piece_end, next_upto
from proxy.prefill.snapshot import ChunkProgress
from proxy.prefill.strategy import PieceChoice, Strategy


@dataclass
class HeldRequest:
    req: Arrived
    done_upto: int
    """Prompt tokens the server holds already (cached at arrival, then fed)."""
    deadline: float
    """`defer`: when the hold ends at the latest."""
    piece_upto: int | None = None
    """The prefix a piece in flight computes; None between pieces."""
    pieces_done: int = 0
    largest_piece: int | None = None
    """The most tokens one of its pieces computed (the strategy's ramp), or a warm-up's of its
    conversation (`Arrived.ramp_from`)."""
    choice: PieceChoice | None = None
    """`chunk`: how the batch cost said it should go on, last time it was asked."""
    behind: bool = False
    """`chunk`: it has fallen behind `max_cold_factor`: from then on to its end, catch-up pieces
    with BEHIND_SHARE's short pauses, and it no longer yields to others' prompts (rules 6 and 8).
    To its end: after a catch-up piece the bound looks met again, but only at that piece size
    (bench day, `-np 5`: `ann-5` after her summary went 64-token pieces, catch-up, 64 again, 17
    pieces in all, 6.5 s to her first token, 4.3× her time alone)."""
    hold_until: float | None = None
    """`chunk`: held until then because no piece size helped (the strategy's HOLD)."""
    caught_up: str | None = None
    """`chunk`: why it is no longer held (its hold ended, or its rest is a short turn's work): it
    goes on behind its bound in the strategy's catch-up pieces (rule 8), not whole: sent whole,
    such a rest stalls every stream for all of it (1,000-1,500 tokens: 2.6 s in `bench
    contention`, a 2,000-token rest after a hold 8 s in `bench day`, on this CPU)."""
    background: bool = False
    """Rule 1: a background job (its purpose) that found slots to spare: cold by a smaller stall,
    fed in pieces that keep the streams' promise whatever they cost it, never held or caught up;
    once somebody waits for a slot, its rest goes as a chat turn's `split` (its pauses would keep
    the slot for seconds). One that arrived when slots were scarce is judged as a chat turn
    (`req.background` still says its purpose: it lets the chat turns have a free slot first, rule
    12)."""
    split: bool = False
    """Rule 1: a chat turn, not cold, whose batch sent whole would stall the streams beyond their
    promise (`split_reason`): its rest goes in the strategy's SPLIT pieces back to back (its rule
    9), never paused, held, caught up or bound by `max_cold_factor`."""
    waiting_since: float = 0.0
    """When it last got something: its arrival, then the end of each of its pieces (rule 4's
    turn: a plan that has waited its own time alone since then goes before the others)."""

    @property
    def has_slot(self) -> bool:
        """A piece of it is in flight or was computed: a slot holds its prefix, and the policy
        keeps that slot for it (rule 12), so that a short turn sent meanwhile cannot take the
        last one and leave it waiting for somebody's whole reply (bench day: bob's first turn 18 s
        behind a translation)."""
        return self.piece_upto is not None or self.pieces_done > 0

    def piece_end(self, piece: int) -> int:
        """Where its next piece of about `piece` tokens ends (rule 17: a first piece reaches
        `first_upto`, within bounds; rule 18: a rest of under TILE_ROWS goes with it, but one
        token)."""
        total = self.req.est_prompt_tokens
        upto = next_upto(self.done_upto, piece)
        if not self.has_slot:
            upto = first_piece_end(upto, self.req.first_upto, total)
        return absorb_tail(upto, total, leave=1)

    def alone_ms(self, cost: BatchCost, n_batch: int) -> float:
        """Its new tokens' time with nobody else on the server, as the batch cost predicts it."""
        req = self.req
        cached = max(0, req.est_prompt_tokens - req.est_new_tokens)
        return cost.prompt_ms(req.est_new_tokens, cached, n_batch)

    def due_at(self, cost: BatchCost, n_batch: int) -> float:
        """Rule 4: from then on it has waited its own time alone for its next piece."""
        return self.waiting_since + self.alone_ms(cost, n_batch) / 1000.0

    def catch_up(self, why: str) -> None:
        """Held no longer: catch-up pieces from now on (their pauses BEHIND_SHARE's), the first
        one without yielding to others' prompts (rule 8 of the policy)."""
        self.caught_up, self.behind = why, True

    @property
    def rest(self) -> int:
        """Prompt tokens still to compute."""
        return self.req.est_prompt_tokens - self.done_upto

    def rest_key(self) -> tuple[int, float]:
        """Rule 4's order: the fewest tokens left first, then the earliest arrival."""
        return self.rest, self.req.now

    @classmethod
    def for_request(cls, req: Arrived, max_hold_s: float, background: bool,
                    split: bool = False) -> HeldRequest:
        cached = max(0, req.est_prompt_tokens - req.est_new_tokens)
        return cls(req=req, done_upto=cached, deadline=req.now + max_hold_s, background=background,
                   split=split, waiting_since=req.now, largest_piece=req.ramp_from or None)

    def release(self, why: str) -> Admit | Forward:
        """Admit if no piece was fed, else Forward; the reason says how far the feeding got, and
        why the batch cost chose larger pieces or a hold if it did."""
        if self.background and self.split:  # rule 1: it went on as a chat turn's split
            why = f"somebody waits for a slot: {why}"
        if self.pieces_done == 0:
            text = why if self.split else f"cold, {why}"  # split: not cold, its note says why
        else:
            text = f"{why} after {self.pieces_done} pieces ({self.done_upto} tokens fed)"
        choice = self.choice
        if choice is not None and choice.strategy in (Strategy.LARGER_PIECES, Strategy.HOLD,
                                                      Strategy.CATCH_UP, Strategy.SPLIT):
            text += f"; {choice.strategy.value}: {choice.reason}"
        return Admit(self.req.req_id, text) if self.pieces_done == 0 else Forward(self.req.req_id,
                                                                                   text)

    def progress(self, next_piece_at: float) -> ChunkProgress:
        """`next_piece_at`: when the policy's next piece may go (after the last one's pause)."""
        return ChunkProgress(
            req_id=self.req.req_id, done_tokens=self.done_upto,
            total_tokens=self.req.est_prompt_tokens, pieces_done=self.pieces_done,
            piece_in_flight_upto=self.piece_upto,
            next_piece_at=next_piece_at if self.piece_upto is None else None)


def shortest_rest(plans: Iterable[HeldRequest]) -> HeldRequest:
    """The plan the next piece goes to (rule 4); ValueError when there is none."""
    return min(plans, key=HeldRequest.rest_key)
