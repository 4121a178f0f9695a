"""The cold requests the prefill policy holds or feeds, and their turn (rules 4-8 of
`PrefillPolicy`): which plan the next piece goes to, how large, the pause after it, and when a plan
is released. Pure; the policy owns it and says what the server is doing (`Server`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from proxy.config import PrefillConfig
from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.events import Admit, FeedPiece, Forward
from proxy.prefill.held import HeldRequest, shortest_rest
from proxy.prefill.outlook import BEHIND_SHARE, ChunkKnobs, Situation
from proxy.prefill.pacing import bound_need, bound_share, idle_piece
from proxy.prefill.server_use import ServerUse
from proxy.prefill.sizing import pause_s
from proxy.prefill.slot_line import Place, place
from proxy.prefill.strategy import (
    PieceChoice,
    Strategy,
    background_piece,
    catch_up_piece,
    choose_piece,
    split_piece,
)

Release = tuple[HeldRequest, Admit | Forward]
"""A plan that ends: its request goes upstream with this decision (the policy sends it)."""


@dataclass(frozen=True)
class Server:
    """What the plans need to know, at one moment, of the operator's knobs and the server."""

    cfg: PrefillConfig
    n_batch: int
    cost: BatchCostModel
    use: ServerUse
    other_piece: bool
    """A warm-up's piece or a save is in flight: the one piece in flight is not a plan's."""
    free_slots: int | None = None
    """Slots nobody uses or keeps (rule 12); None: the server's slot count is unknown."""
    slot_wanted: bool = False
    """Somebody is held for a slot (rules 12 and 14): a background job's rest goes whole (rule 1)."""
    first_held: Place | None = None
    """Where the first request held for a slot stands at `now` (slot_line.py's `place`)."""
    now: float = 0.0

    def takes(self, held: HeldRequest) -> bool:
        """Whether a plan may use the server now: it keeps a slot, or one is free and nobody held
        for a slot stands before it (rule 12: a free slot with somebody held is owed to a plan
        at or before their place, never to one after it)."""
        if held.has_slot or self.free_slots is None:
            return True
        return self.free_slots > 0 and self.not_behind_the_line(held)

    def not_behind_the_line(self, held: HeldRequest) -> bool:
        """Nobody held for a slot stands before this plan (slot_line.py's `place`)."""
        return (self.first_held is None
                or place(held.req, self.now, self.cfg.max_hold_s) <= self.first_held)


class ColdPlans:
    def __init__(self) -> None:
        self.held: dict[str, HeldRequest] = {}  # in arrival order
        self.next_piece_at = 0.0
        self._next: str | None = None  # the plan first in turn at the last step

    def __bool__(self) -> bool:
        return bool(self.held)

    def __len__(self) -> int:
        return len(self.held)

    def __iter__(self) -> Iterator[str]:
        return iter(self.held)

    def fed(self) -> int:
        """Plans with a piece in flight (at most one)."""
        return sum(1 for p in self.held.values() if p.piece_upto is not None)

    def slots_kept(self) -> int:
        """Slots the plans use or keep (rule 12): one per plan a piece of which went."""
        return sum(1 for p in self.held.values() if p.has_slot)

    def slots_owed(self, server: Server, now: float) -> int:
        """Rules 4 and 12: `chunk` plans with no slot yet that have waited their own time alone
        since they arrived, and are not in a hold; each is owed the next free slot, before the
        requests held for one (else, with every slot busy and short turns always waiting, a cold
        request never gets its first piece: bench day, a 593-token translation held 305 s). But
        not before the first request held for one if that one's place is before theirs
        (`Server.not_behind_the_line`, slot_line.py's `place`: arrival order, background jobs
        after the chat turns for `max_hold_s`; bench day: a translation that came 11 s after
        `bob-1` took the slot he had waited 21 s for, and he waited 27 s)."""
        if server.cfg.mode != "chunk":
            return 0
        cost, n_batch = server.cost.cost, server.n_batch
        return sum(1 for p in self.held.values()
                   if not p.has_slot and p.due_at(cost, n_batch) <= now
                   and (p.hold_until is None or p.hold_until <= now)
                   and server.not_behind_the_line(p))

    # ---- events ------------------------------------------------------------------------------

    def piece_done(self, server: Server, req_id: str, tokens: int, elapsed_ms: float,
                   now: float) -> bool:
        """Rules 6 and 9: the piece teaches the cost and sets the pause; False if unknown."""
        held = self.held.get(req_id)
        if held is None or held.piece_upto is None:
            return False
        server.cost.observe_piece(tokens, held.piece_upto - tokens, elapsed_ms,
                                  server.use.decoders(), server.use.cells())
        sent = held.piece_upto - held.done_upto
        held.done_upto, held.piece_upto = held.piece_upto, None
        held.pieces_done += 1
        held.waiting_since = now
        # the ramp (rule 1) from the piece as sent: one whose tokens the server had cached computed
        # few, and from those the ramp would start again at a few (bench day: a 2,290-token turn
        # whose prefix llama-server's RAM cache held went in 271 pieces, 265 of one token, 104 s)
        held.largest_piece = max(held.largest_piece or 0, tokens, sent)
        if held.split:  # rule 1: back to back, the streams' token after each piece their pause
            self.next_piece_at = now
            return True
        own, waiting = self._needs(server, held, now)
        share = bound_share(own, server.cfg.prefill_share)  # the fed plan's own (rule 6)
        held.behind = held.behind or share >= 1.0  # once behind, to its end (rule 6)
        if held.choice is not None and held.choice.strategy is Strategy.CATCH_UP:
            share = BEHIND_SHARE
        if waiting:
            # the pause is the server's, not the plan's: plans waiting for their turn wait
            # through it too, so it is what lets all of them meet their bounds (rule 4: the
            # day's first two turns, 1,998 and 1,638 tokens a second apart beside one stream,
            # each waited through the other's pieces and pauses priced for one plan: the second
            # took 2.1-3.0x alone)
            share = max(share, bound_share([*own, *waiting], server.cfg.prefill_share))
        self.next_piece_at = now + pause_s(elapsed_ms / 1000.0, min(share, BEHIND_SHARE))
        return True

    def _needs(self, server: Server, fed: HeldRequest, now: float
               ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """Rule 6's `bound_need` of the plan just fed, and of every other plan that would take
        the next piece were it its turn (not in a hold, a slot for it); none for a background
        job or with `max_cold_factor` 0 (no bound)."""
        cfg = server.cfg
        if cfg.max_cold_factor <= 0:
            return [], []

        def need(plan: HeldRequest) -> tuple[float, float]:
            return bound_need(server.cost.cost, cfg, server.n_batch, plan,
                              server.use.decoders(), now, server.use.cells())

        waiting = [need(p) for p in self.held.values() if p is not fed and not p.background
                   and (p.hold_until is None or p.hold_until <= now) and server.takes(p)]
        return ([] if fed.background else [need(fed)]), waiting

    # ---- deciding ----------------------------------------------------------------------------

    def step(self, server: Server, now: float) -> Release | FeedPiece | None:
        """Rules 4-8: the one thing the plans do next, if anything."""
        if not self.held:
            return None
        if server.cfg.mode == "defer":
            return self._defer_step(server, now)
        if server.other_piece or self.fed():
            return None
        turn = [p for p in self.turn(server, now) if server.takes(p)]
        if not turn:
            return None
        if not server.use:
            return self._idle(server, turn[0])
        for held in turn:
            if held.hold_until is not None:
                if now < held.hold_until:
                    continue
                held.hold_until = None
                held.catch_up(f"its hold ended with {server.use.decoders()} generating")
            if held.background and server.slot_wanted:
                held.split = True  # rule 1: its pauses would keep the slot; back to back now
            choice = held.choice = self.choice(server, held)
            if choice.strategy is Strategy.HOLD:
                if held.rest >= server.cfg.cold_tokens:
                    held.hold_until = now + choice.hold_ms / 1000.0
                    continue
                held.catch_up(f"its rest ({held.rest} tokens) is under cold_tokens: not held")
                choice = held.choice = self.choice(server, held)
            if choice.strategy is Strategy.WHOLE:
                return held, held.release(choice.reason)
            if self._piece_waits(server, held, now):
                return None
            return self._feed(held, choice.piece_tokens)
        return None

    def turn(self, server: Server, now: float) -> list[HeldRequest]:
        """Rule 4's order: first the plans that have waited their own time alone since they last
        got a piece (or arrived), the longest overdue first, so that cold requests take turns
        rather than one waiting for the whole of another stretched out beside the streams (bench
        day: the day's two first turns, 1,998 and 1,638 tokens, the second held 12 s behind the
        first, ~4 s alone); then the fewest tokens left, then the earliest."""
        cost, n_batch = server.cost.cost, server.n_batch

        def key(plan: HeldRequest) -> tuple[int, float, float]:
            due = plan.due_at(cost, n_batch)
            return (0, due, 0.0) if due <= now else (1, *plan.rest_key())

        order = sorted(self.held.values(), key=key)
        self._next = order[0].req.req_id if order else None
        return order

    def choice(self, server: Server, held: HeldRequest) -> PieceChoice:
        """How a plan would go on now (rule 6), from the fitted cost."""
        cfg = server.cfg
        knobs = ChunkKnobs(max_stall_ms=cfg.max_stall_ms, n_batch=server.n_batch,
                           prefill_share=cfg.prefill_share, max_hold_ms=cfg.max_hold_s * 1000.0)
        situation = Situation(done_tokens=held.done_upto, remaining_tokens=held.rest,
                              decoders=server.use.decoders(), cells=server.use.cells(),
                              largest_piece=held.largest_piece,
                              probe=server.cost.needs_probe())
        if held.split:
            return split_piece(server.cost.cost, situation, knobs)
        if held.background:
            return background_piece(server.cost.cost, situation, knobs)
        if held.caught_up is not None or held.behind:
            why = held.caught_up or (f"behind max_cold_factor ({cfg.max_cold_factor:g}× its time "
                                     "alone)")
            return catch_up_piece(server.cost.cost, situation, knobs, why)
        return choose_piece(server.cost.cost, situation, knobs)

    def _defer_step(self, server: Server, now: float) -> Release | None:
        for held in self.held.values():
            if now >= held.deadline:
                return held, Admit(held.req.req_id, "held prefill.max_hold_s")
        if server.use or server.other_piece:
            return None
        held = shortest_rest(self.held.values())
        return held, Admit(held.req.req_id, "held until others finished")

    def _piece_waits(self, server: Server, held: HeldRequest, now: float) -> bool:
        """Rules 6 and 8: the pause after the last piece, and others' prompts (unless behind)."""
        use = server.use
        return now < self.next_piece_at or (not held.behind and (
            use.prefilling() or now < use.sent_grace_end()))

    def _idle(self, server: Server, held: HeldRequest) -> Release | FeedPiece:
        """Rule 7: nobody generates: the rest whole if it is short, else an idle piece."""
        piece = idle_piece(server.cost.cost, server.cfg, server.n_batch, held, held.rest)
        if piece is None:
            return held, held.release("nobody generating")
        return self._feed(held, piece)

    @staticmethod
    def _feed(held: HeldRequest, piece: int) -> FeedPiece:
        held.piece_upto = held.piece_end(piece)
        return FeedPiece(held.req.req_id, held.piece_upto)

    # ---- queries -----------------------------------------------------------------------------

    def next_wakeup(self, server: Server) -> float | None:
        if not self.held:
            return None
        if server.cfg.mode == "defer":
            return min(p.deadline for p in self.held.values())
        # A plan with no slot to go into moves on when one frees (an event), never by the clock:
        # a time already past would have the wake loop call `on_tick` back to back for nothing.
        able = [p for p in self.held.values() if server.takes(p)]
        holds = [p.hold_until for p in able if p.hold_until is not None]
        active = self.active()
        if (not able or active is None or active.piece_upto is not None
                or active.hold_until is not None or server.other_piece):
            pieces = None  # an event (PieceDone, FirstToken, Finished) moves the plans on
        elif active.behind:
            pieces = self.next_piece_at
        elif server.use.prefilling():
            pieces = None
        else:
            pieces = max(self.next_piece_at, server.use.sent_grace_end())
        return min([*holds, *([pieces] if pieces is not None else [])], default=None)

    def active(self) -> HeldRequest | None:
        """The plan with a piece in flight, else the one the next piece goes to (one not holding,
        if any)."""
        plans = self.held.values()
        fed = next((p for p in plans if p.piece_upto is not None), None)
        if fed is not None:
            return fed
        going = [p for p in plans if p.hold_until is None] or list(plans)
        first = next((p for p in going if p.req.req_id == self._next), None)
        return first or (shortest_rest(going) if going else None)
