"""The prefill policy, the one decider of llama-server's time: its rules and the events it hears.
Pure and synchronous: events in, decisions out; no I/O, no clock (every call takes `now`), no log.
What it knows and counts is `policy_state.py`'s, its steps `deciding.py`'s, the cold plans' turn
`plans.py`'s; the warm-ups and the keep store choose their own work, it says when they may.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.config import PrefillConfig
from proxy.prefill.batch_cost import Row
from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.deciding import advance, arrive, release, release_trim
from proxy.prefill.events import (
    Admit,
    Arrived,
    CancelPiece,
    Decision,
    Forward,
    Hold,
    Load,
    Restorable,
    Save,
    Sizer,
)
from proxy.prefill.learning import learn_prefill
from proxy.prefill.policy_state import PolicyState
from proxy.prefill.restores import wait_s
from proxy.prefill.snapshot import PolicySnapshot
from proxy.record.flight import Phase

STUCK_PAUSE_S = 0.05
"""`next_wakeup` still the same after the tick it asked for, nothing having moved it, is a bug of
this policy's; whoever drives it (the gate's loop, the what-if's replay) then waits this long
between such ticks rather than call `on_tick` back to back (a core spinning beside llama-server)."""


class PrefillPolicy:
    """Decides, per request, Admit / Hold / FeedPiece / Restore / Save / Forward / Reject / CancelPiece.

    Rules (tests/test_policy.py follows them one to one; the bench-day cases that made each one are
    next to the code that carries it out):
     1. A request is cold when its estimated new tokens are >= `cold_tokens`; in `chunk`, while
        others generate (or are about to: sent, their own prompt computing), also one of at least
        MIN_PIECED_TOKENS whose batch, sent whole, the measured batch cost predicts would stall
        them over WHOLE_STALLS × `max_stall_ms` (cold.py). A background job (its purpose one of
        `background_purposes`) is cold by its stall already from BACKGROUND_STALLS ×
        `max_stall_ms` and MIN_BACKGROUND_TOKENS new tokens: nobody reads it as it comes. While
        others generate it goes in pieces that keep their promise whatever they cost it (the
        strategy's `background_piece`, pauses at `prefill_share`): never held, caught up or bound
        by `max_cold_factor`. But only while slots are to spare: one that arrives when somebody
        waits for a slot or it would take the last free one is judged as a chat turn, and a plan's
        rest goes on as a chat turn's split below once somebody waits for a slot (its pauses
        would keep a slot for seconds: `PolicyState.slots_scarce`). A chat turn not cold so, of
        MIN_SPLIT_TOKENS new tokens or more, whose batch sent whole would still stall the streams
        beyond their promise (STALL_SLACK × `max_stall_ms`, `split_reason`) goes in the
        strategy's SPLIT pieces back to back (`split_piece`): the streams wait one piece, the turn
        only the pieces' fixed parts; never paused, held, caught up or bound by
        `max_cold_factor`. Any other request is admitted at once and never waits behind a cold
        one (but see rule 12's kept slots and rule 14's claimed slot).
     2. Mode `off`: every request is admitted at once (rule 14 still restores kept KV first).
     3. Somebody is generating while a request that was sent upstream has not finished (sent,
        prefilling or decoding). A cold request that finds nobody generating and no cold request
        held goes at full speed: `defer` admits it at once; `chunk` sends it whole if it is short,
        else in idle pieces back to back (rule 7), so that whoever comes meanwhile (a returning
        user's restore, a short turn) waits for one piece, not for the whole prompt.
     4. Cold requests share the prefill time: each one held has its own plan, at most one piece is
        in flight, and the next piece (or release) goes to the plan with the fewest tokens left to
        compute, then the earliest: a short first turn waits for the piece in flight, not for a
        long history's whole rest; but a plan that has waited its own time alone (the batch
        cost's, nobody else on the server) since its last piece or its arrival goes first, the
        longest overdue first: beside the streams the shortest rest is stretched out in pieces
        and pauses, and a second cold request is never held for the whole of it
        (`ColdPlans.turn`). One held beyond `max_waiting` + 1 is rejected.
     5. `defer`: cold requests are held while others generate; when nobody does, the one with the
        fewest tokens left is admitted (it then generates, and the others wait for it); each is
        admitted by `on_tick` once it has been held `max_hold_s` since its arrival.
     6. `chunk`: while others generate, the chosen plan goes on the way `choose_piece`
        (strategy.py, its own numbered rules) picks from the fitted batch cost at its prefix:
        PIECES, LARGER_PIECES or CATCH_UP: fed as cumulative token-id prefixes, FeedPiece(upto),
        starting after the tokens already cached; after each piece, whoever's it was, the next one
        waits a pause of piece_time * (1 - share) / share (`on_tick` sends it), share =
        `prefill_share`, or more when the fed request, or a plan waiting for its turn (it waits
        through the pauses too), would otherwise take over `max_cold_factor` × its time alone:
        the share that lets every one meet its bound, the soonest first (`pacing.bound_share`)
        (BEHIND_SHARE after a CATCH_UP piece), but never above BEHIND_SHARE: a request behind its
        bound shortens the streams' pauses, never removes them, and goes on in the strategy's
        catch-up pieces (larger ones, its rule 8), so their longest gap stays about one piece; to
        its end: after a catch-up piece the bound looks met again, but only at that piece size,
        and back in fitting pieces it fell behind again at once (`HeldRequest.behind`). WHOLE
        (the rest fits one piece, or no option beats sending it): the real request is forwarded.
        HOLD: that plan is held like `defer` until the hold the strategy chose ends or nobody
        generates (rule 7); the other plans go on meanwhile; but a rest under `cold_tokens` is
        never held (a short turn's work, which rule 1 sends at once: holding it keeps its user
        waiting for nobody's gain). A plan whose hold ended with others still generating, or
        whose rest under `cold_tokens` would be held, goes on behind its bound in the strategy's
        catch-up pieces (its rule 8), not whole: sent whole, such a rest stalls every stream for
        all of it, in pieces they wait one piece at a time (`HeldRequest.caught_up`).
     7. `chunk`: as soon as nobody is generating, the chosen plan's rest goes at full speed:
        forwarded at once if its predicted time is under IDLE_WHOLE × `max_stall_ms`, else fed in
        pieces of up to IDLE_STALL × `max_stall_ms` back to back (in a chat, users pause between
        turns; one who comes back waits for one such piece, not for the whole rest). A piece
        already in flight is let finish first, since its work is kept in the cache.
     8. Short requests that arrive while a cold one is fed are admitted at once (rule 1); the plan
        is unchanged: the next piece still waits for its pause, and also while any other request
        is computing its prompt (PREFILLING) or was sent less than SENT_GRACE_S ago and has not
        started it yet, so that short prompts go between pieces, not into a piece's batch; unless
        the fed request has fallen behind `max_cold_factor`: then it no longer yields (chat users
        whose turns come one after another would starve it).
     9. The batch cost (batch_cost.py, fitted by cost_fit.py) is learned from every piece (its
        time at its prefix, with the streams decoding beside it) and every finished request's
        prefill (prompt_n after cache_n in prompt_ms, if >= LEARN_MIN_TOKENS: learning.py); it
        starts at a conservative prior.
    10. A client that leaves ends its part at once: its plan ends (CancelPiece if a piece is in
        flight), a waiting request leaves its line, a sent request stops counting as generating.
    11. A failed piece ends its plan: the real request is forwarded as it came (fail open), with
        the reason.
    12. Every slot user counts (`PolicyState.taken`): requests sent, restores running, a warm-up's
        piece or a save in flight, and every cold plan a piece of which went: between its pieces
        its slot is idle in the server, but kept for it (a short turn sent then could take the
        last slot: `HeldRequest.has_slot`). With the server's slot count known (`set_layout`), the
        free slots are the rest; when none is, a request that would go now is held instead (it
        would only queue in the server) and they go in arrival order, one per slot that frees,
        before a cold plan's first piece, unless that plan has waited its own time alone since it
        arrived (rule 4's bound): then the slot is its own, but never before one held for a slot
        whose place is before its own. A background job (its purpose, whatever rule 1 judged it)
        takes its place after the chat turns until it has waited `max_hold_s` since it arrived
        (slot_line.py's `place`); a restore waiting goes before them all (rule 14).
        How long each was held so is its record's `slot_wait_ms` (`slot_wait_s`).
    13. A reload (`reconfigure`) rules from then on; held requests are never dropped: with mode
        `off` every plan is released at once.
    14. Restores (keep_kv). A request a kept file holds part of (`Restorable`) is restored before
        it goes: Restore when a slot is free, else it waits for one, up to `max_wait_s`
        (`restores.wait_s`; not at all when computing would cost no more than restoring). The next
        slot to come free is claimed for it (`SlotLine.claimed`): while a restore waits and no
        slot is free, other requests are held behind it (they would queue in the server anyway)
        until it is sent; while a restore runs, all are: llama-server could give a request sent
        meanwhile the very slot being restored, and then runs the restore only after that
        request's whole reply; and after it, until the restored request has started its prompt:
        sent at once beside it, another request could take the restored slot first; then, until
        its first token, all but prompts of at most a tile, which would share its batch; at most
        LANDING_MAX_S in all (slot_line.py).
        Restored (`on_restored`), it is decided as if it arrived then, with the estimate the
        restore left (a returning conversation is no longer cold). A restore that found no idle
        slot waits for the next request to finish; one that failed otherwise, or whose wait ran
        out, is decided as it came (computed), with the reason.
    15. Warm-ups (the warm-up queue, proxy/warm/queue.py, decides which and how far) are the lowest
        priority: `warm_load` tells the queue what real requests do (a cold request held or a
        restore waiting stops them; a request just sent pauses them: its prompt starts alone; so
        does every slot taken: sent then, a piece would wait in the server's queue and take the
        next slot to come free before the requests held for one (`Load.no_slot`); a piece may
        join a real prompt's batch, adding at most `max_stall_ms`), `warm_sizer` sizes
        their pieces from the same batch cost, and their pieces in flight (`on_warm_pieces`) count
        like a cold request's: a slot, and the one piece in flight (a cold request that arrives
        meanwhile is not on an idle server: it waits for that piece); each teaches the cost. A
        request that ends a warm-up of its conversation (`ramp_from`) ramps its own pieces up from
        the warm-up's largest, a size measured at its prefix beside the same streams.
    16. Saves (keep_kv) are tasks on the server's main loop like a piece: one goes (Save, from
        `on_save_due`) only when the server is quiet (`save_ok`: nothing sent, held, fed, restored
        or warmed), and until `on_save_done` it counts as a slot user and the piece in flight: a
        cold request arriving meanwhile waits for it, restores and warm-ups wait, short requests
        are admitted (the server runs them after the save).
    17. A plan's first piece ends at `Arrived.first_upto` at least (`sizing.first_piece_end`:
        rounded up to a multiple of 64, when that is at most FIRST_PIECE_MAX and a quarter of the
        prompt): llama-server places each piece by its own similarity to the slots, and a short
        first piece that shares the chat template's head with another prompt's slot is put there,
        taking the slot of a plan fed in pieces. Past the floor it goes where the whole prompt
        would.
    18. A piece never leaves a rest of under TILE_ROWS tokens (`sizing.absorb_tail`): it takes
        all of it but one token. ggml's CPU flash attention computes a batch of fewer rows one row
        at a time (sizing.py's TILE_ROWS); one token left is one row, the price of a decode token.
        Pieces end on multiples of 64 and prompts do not, so without this every plan's rest was
        such a batch.
    19. A short turn of under TILE_ROWS new tokens after a long cached history, about to go
        (`trim_short_turns`, any mode but off), is trimmed when that pays the turn, counting the
        whole decode step its trim piece rides in (narrow.py, which says what row by row costs),
        and so is a longer prompt about to go whole whose last micro-batch (`n_ubatch`) would hold
        under TILE_ROWS rows: a piece of its prompt goes first (a short turn's first
        `len - TILE_ROWS` ids), so that llama-server keeps only those of the slot's cells and the
        prompt computes its last 64 tokens in one tile, not its few row by row; 65 while anybody
        decodes (`narrow.trim`: on a KV per slot one of them may go with the decode token of the
        slot below). Decode tokens fill the turn's tile only on one shared KV (`set_layout`). The
        row-by-row price is learned from the requests that computed such a batch (`on_finished`):
        none on a GPU, and then nothing is trimmed. Nor is a turn whose estimate counts a held
        reply as cached (`guessed_tokens`) until follow-ups on this server were seen to find their
        reply whole (estimate/replies.py): where the template renders it otherwise, the trim piece
        computes what the estimate missed, row by row when under 64 tokens. A machine seen to
        change (the batch cost's shift) learns the price again; a prompt whose last micro-batch was
        short teaches the batch cost nothing (its tiled form cannot tell). The trim piece is in
        flight like a cold request's and teaches no cost; its end (or failure) sends the turn. From
        the piece to the turn's first token the turn lands as after a restore (rule 14): a longer
        prompt sent meanwhile would share the short batches that are the trim's point.
    """

    def __init__(self, config: PrefillConfig, *, n_batch: int = 2048,
                 cost: BatchCostModel | None = None, slots: int | None = None) -> None:
        if n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {n_batch}")
        self._st = PolicyState(config, n_batch, cost if cost is not None else BatchCostModel(),
                               slots)
        self.save_ms: float | None = None
        """What the last save cost the server's main loop (rule 16)."""

    # ---- events ----------------------------------------------------------------------------

    def on_arrival(self, req_id: str, est_new_tokens: int, est_prompt_tokens: int,
                   now: float, restorable: Restorable | None = None, *,
                   first_upto: int = 0, background: bool = False,
                   guessed_tokens: int = 0, ramp_from: int = 0) -> list[Decision]:
        """`first_upto`: where a first piece ends at least (rule 17); `background`: its purpose is
        one of `background_purposes` (rule 1); `guessed_tokens`: of its cached tokens, a held
        reply's not known to be found (rule 19); `ramp_from`: a warm-up's largest piece of its
        prompt (rule 15)."""
        st = self._st
        arrived = Arrived(req_id, est_new_tokens, est_prompt_tokens, now, first_upto, background,
                          guessed_tokens, ramp_from)
        wait = (wait_s(st.cost.cost, arrived, restorable, st.n_batch)
                if restorable is not None and restorable.tokens > 0 else 0.0)
        if restorable is not None and wait > 0:
            st.line.restores.add(arrived, restorable, wait)
            return [Hold(req_id, "waiting for a slot to restore its kept KV into"),
                    *advance(st, now)]
        return arrive(st, arrived, now)

    def on_restored(self, req_id: str, est_new_tokens: int, now: float) -> list[Decision]:
        """Its file is in a slot now; `est_new_tokens` are left to compute."""
        st = self._st
        waiting = st.line.restores.pop(req_id)
        if waiting is None:
            return []
        req = waiting.req
        decided = arrive(st, Arrived(req_id, est_new_tokens, req.est_prompt_tokens, req.now,
                                     background=req.background, ramp_from=req.ramp_from), now)
        if any(isinstance(d, Admit) and d.req_id == req_id for d in decided):
            st.line.land(req_id, now)
        return [*decided, *advance(st, now)]

    def on_restore_failed(self, req_id: str, reason: str, now: float, *,
                          no_slot: bool = False) -> list[Decision]:
        """`no_slot`: no idle slot was found: it waits for the next request to finish."""
        st = self._st
        waiting = st.line.restores.waiting.get(req_id)
        if waiting is None:
            return []
        waiting.running = False
        if no_slot and now < waiting.until:
            waiting.needs_a_finish = True
            return advance(st, now)
        st.line.restores.pop(req_id)
        st.notes[req_id] = f"keep_kv: {reason}, computed instead"
        return [*arrive(st, waiting.req, now), *advance(st, now)]

    def learned(self) -> tuple[list[tuple[Row, float, float]], list[float]]:
        """What it measured of this server: the batch cost's samples and the row-by-row price's
        (prefill/learned.py keeps them across slotwise's restarts)."""
        return self._st.cost.export(), self._st.trims.samples()

    def adopt_learned(self, batches: Sequence[tuple[Row, float, float]],
                      narrow: list[float]) -> None:
        """What `learned` gave before a restart, on the same server, as if measured first."""
        self._st.cost.adopt(batches)
        self._st.trims.adopt(narrow, self._st.cost)

    def set_layout(self, slots: int | None, shared_kv: bool | None) -> None:
        """The server's slot count and whether its slots share one KV pool (`/props`, as
        `layout.ServerLayout` reads it), once known."""
        self._st.line.slots = slots
        self._st.shared_kv = shared_kv

    def on_prefill_started(self, req_id: str, now: float) -> list[Decision]:
        st = self._st
        st.use.moved(req_id, Phase.PREFILLING)
        return advance(st, now) if st.line.prompt_started(req_id) else []

    def on_first_token(self, req_id: str, now: float) -> list[Decision]:
        st = self._st
        st.use.moved(req_id, Phase.DECODING)
        landed = st.line.landed(req_id)
        return advance(st, now) if st.plans or landed else []

    def on_finished(self, req_id: str, now: float, prompt_n: int | None = None,
                    prompt_ms: float | None = None, cache_n: int = 0) -> list[Decision]:
        st = self._st
        if prompt_n is not None and prompt_ms is not None:  # rules 9 and 19 (learning.py)
            learn_prefill(st, req_id, prompt_n, prompt_ms, cache_n)
        st.line.landed(req_id)
        st.line.waited.pop(req_id, None)  # the gate has read it, if it held the request
        if not st.use.ended(req_id):
            return []
        st.line.restores.a_request_finished()
        return advance(st, now)

    def on_piece_done(self, req_id: str, tokens: int, elapsed_ms: float,
                      now: float) -> list[Decision]:
        st = self._st
        trimmed = st.trims.pop(req_id)
        if trimmed is not None:  # rule 19: the turn goes (its piece teaches no cost)
            return [*release_trim(st, trimmed, None, now), *advance(st, now)]
        if not st.plans.piece_done(st.server(), req_id, tokens, elapsed_ms, now):
            return []
        return advance(st, now)

    def on_warm_pieces(self, in_flight: int, now: float) -> list[Decision]:
        """How many warm-up pieces are in flight now (rule 15)."""
        if in_flight == self._st.warm_pieces:
            return []
        self._st.warm_pieces = in_flight
        return advance(self._st, now)

    def on_warm_piece_done(self, tokens: int, ctx: int, elapsed_ms: float) -> None:
        """A warm-up's piece teaches the batch cost like a cold request's (rules 9, 15)."""
        use = self._st.use
        self._st.cost.observe_piece(tokens, ctx, elapsed_ms, use.decoders(), use.cells())

    def on_save_due(self, save_id: str, now: float) -> list[Decision]:
        """Rule 16: the keeper has a slot to save; it goes only on a quiet server."""
        if not self.save_ok():
            return []
        self._st.saving = save_id
        return [Save(save_id)]

    def on_save_done(self, save_id: str, elapsed_ms: float, now: float) -> list[Decision]:
        if self._st.saving != save_id:
            return []
        self._st.saving, self.save_ms = None, elapsed_ms
        return advance(self._st, now)

    def on_piece_failed(self, req_id: str, reason: str, now: float) -> list[Decision]:
        st = self._st
        trimmed = st.trims.pop(req_id)
        if trimmed is not None:
            return [*release_trim(st, trimmed, reason, now), *advance(st, now)]
        held = st.plans.held.get(req_id)
        if held is None:
            return []
        held.piece_upto = None
        return [*release(st, held, Forward(req_id, f"piece failed, forwarded as it came: "
                                                   f"{reason}"), now),
                *advance(st, now)]

    def on_client_left(self, req_id: str, now: float) -> list[Decision]:
        st = self._st
        st.notes.pop(req_id, None)
        waited = st.line.left(req_id, now)
        held = st.plans.held.pop(req_id, None)
        if held is not None:
            cancel: list[Decision] = [CancelPiece(req_id)] if held.piece_upto is not None else []
            return [*cancel, *advance(st, now)]
        if st.trims.pop(req_id) is not None:
            return [CancelPiece(req_id), *advance(st, now)]
        if not st.use.ended(req_id) and not waited:
            return []
        return advance(st, now)

    def on_tick(self, now: float) -> list[Decision]:
        return advance(self._st, now)

    def reconfigure(self, config: PrefillConfig, now: float) -> list[Decision]:
        """A reload: the new config rules from now on. Held requests are never dropped: with
        mode `off` every plan is released at once; otherwise they go on under it."""
        st = self._st
        st.cfg, st.n_batch = config, config.n_batch
        out: list[Decision] = []
        if config.mode == "off":
            for held in list(st.plans.held.values()):
                out.extend(release(st, held, held.release("prefill.mode off (reload)"), now))
        return [*out, *advance(st, now)]

    # ---- queries (policy_state.py counts them) -----------------------------------------------

    def next_wakeup(self) -> float | None:
        """The earliest `now` at which `on_tick` may decide something (None: only events will)."""
        return self._st.next_wakeup()

    def slot_wait_s(self, req_id: str) -> float:
        """How long the request was held because every slot was in use or claimed (rules 12 and
        14), all told; asked once, when the gate is done with it (the record's `slot_wait_ms`)."""
        return self._st.line.waited.pop(req_id, 0.0)

    def save_ok(self) -> bool:
        """Rule 16: whether a save may go now (nobody else uses the server)."""
        return self._st.save_ok()

    def warm_load(self, now: float) -> Load:
        """Rule 15: what real requests are doing, as the warm-up queue decides by it."""
        return self._st.warm_load(now)

    def warm_sizer(self) -> Sizer:
        """Rule 15: a warm-up's pieces are sized like a cold request's, from the same cost."""
        return self._st.warm_sizer()

    def snapshot(self) -> PolicySnapshot:
        return self._st.snapshot()
