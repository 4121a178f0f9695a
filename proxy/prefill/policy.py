"""The prefill policy, the one decider of llama-server's time: when, and in what pieces, a cold
prompt reaches the server, and when restores, saves and warm-ups may use it (their own choices are
the keep store's and the warm-up queue's). Pure and synchronous: events in, decisions out; no I/O,
no clock (every call takes `now`), no log. The cold plans' turn is `plans.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.config import PrefillConfig
from proxy.prefill.batch_cost import Row
from proxy.prefill.cold import stall_reason
from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.events import (
    Admit,
    Arrived,
    CancelPiece,
    Decision,
    FeedPiece,
    Forward,
    Hold,
    Load,
    Reject,
    Restorable,
    Restore,
    Save,
    Sizer,
)
from proxy.prefill.held import HeldRequest
from proxy.prefill.narrow import last_rows
from proxy.prefill.pacing import WarmSizer
from proxy.prefill.plans import ColdPlans, Server
from proxy.prefill.restores import wait_s
from proxy.prefill.server_use import ServerUse
from proxy.prefill.sizing import TILE_ROWS
from proxy.prefill.slot_line import SlotLine
from proxy.prefill.snapshot import PolicySnapshot
from proxy.prefill.trims import Trims
from proxy.record.flight import Phase

STUCK_PAUSE_S = 0.05
"""`next_wakeup` still the same after the tick it asked for, nothing having moved it, is a bug of
this policy's; whoever drives it (the gate's loop, the what-if's replay) then waits this long
between such ticks rather than call `on_tick` back to back (a core spinning beside llama-server)."""
LEARN_MIN_TOKENS = 256
"""A finished request teaches the batch cost only if it computed at least this many tokens. Short
turns are left out: their prompt time is mostly per-request work, and with one shared KV they attend
over other slots' cells the model does not see, so they read as a much cheaper machine than the
one a piece meets (seen: pieces predicted at 85 ms that took 240)."""

class PrefillPolicy:
    """Decides, per request, Admit / Hold / FeedPiece / Restore / Save / Forward / Reject / CancelPiece.

    Rules (tests/test_policy.py follows them one to one):
     1. A request is cold when its estimated new tokens are >= `cold_tokens`; in `chunk`, while
        others generate (or are about to: sent, their own prompt computing), also one of at least
        MIN_PIECED_TOKENS whose batch, sent whole, the measured batch cost predicts would stall
        them over WHOLE_STALLS × `max_stall_ms`
        (cold.py: a warmed post-summary rest under `cold_tokens` froze every stream 6-7 s in
        `bench day`). A background job (its purpose one of `background_purposes`) is cold by
        its stall already from BACKGROUND_STALLS × `max_stall_ms` and MIN_BACKGROUND_TOKENS new
        tokens: nobody reads it as it comes, and sent whole beside the streams a 600-token
        translation froze them 1.5-1.9 s in `bench day`. While others generate it goes in pieces
        that keep their promise whatever they cost it (the strategy's `background_piece`, pauses
        at `prefill_share`): never held, caught up or bound by `max_cold_factor`. But only while
        slots are to spare: one that arrives when somebody waits for a slot or it would take the
        last free one is judged as a chat turn, and a plan's rest goes whole once somebody waits
        for a slot (its pieces keep a slot for seconds: on `bench day`'s four slots for six
        clients, translations fed in pieces made the chat turns' slot waits grow, their p90 from
        10.4-10.8 to 13.2-14.4 s). Any other
        request is admitted at once and never waits behind a cold one (but see rule 12's kept
        slots and rule 14's claimed slot).
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
        and pauses, and a second cold request is never held for the whole of it (bench day: the
        day's two first turns, 1,998 and 1,638 tokens, the second held 12 s behind the first,
        ~4 s alone). One held beyond `max_waiting` + 1 is rejected.
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
        the share that lets every one meet its bound, the soonest first (at each bound, the rests
        due by then over the time left until it; bench day: the day's two first turns beside one
        stream, each paced for itself alone, the second took 2.1-3.0× its time alone)
        (BEHIND_SHARE after a CATCH_UP piece), but never above
        BEHIND_SHARE: a request behind its bound shortens the streams' pauses, never removes
        them, and goes on in the strategy's catch-up pieces (larger ones, its rule 8), so their
        longest gap stays about one piece; to its end: after a catch-up piece the bound looks
        met again, but only at that piece size, and back in fitting pieces it fell behind again
        at once (bench day, `-np 5`: `ann-5` after her summary went 64-token pieces, catch-up,
        64 again, 17 pieces in all, 6.5 s to her first token, 4.3× her time alone). WHOLE (the rest
        fits one piece, or no option beats sending it): the real request is forwarded. HOLD: that
        plan is held like `defer` until the hold the strategy chose ends or nobody generates
        (rule 7); the other plans go on meanwhile; but a rest under `cold_tokens` is never held
        (a short turn's work, which rule 1 sends at once: holding it keeps its user waiting for
        nobody's gain). A plan whose hold ended with others still generating, or whose rest under
        `cold_tokens` would be held, goes on behind its bound in the strategy's catch-up pieces
        (its rule 8), not whole: sent whole, such a rest stalls every stream for all of it
        (1,000-1,500 tokens: 2.6 s in `bench contention`, a 2,000-token rest after a hold 8 s in
        `bench day`, on this CPU), in pieces they wait one piece at a time.
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
        prefill (prompt_n after cache_n in prompt_ms, if >= LEARN_MIN_TOKENS); it starts at a
        conservative prior.
    10. A client that leaves ends its part at once: its plan ends (CancelPiece if a piece is in
        flight), a waiting request leaves its line, a sent request stops counting as generating.
    11. A failed piece ends its plan: the real request is forwarded as it came (fail open), with
        the reason.
    12. Every slot user counts: requests sent, restores running, a warm-up's piece or a save in
        flight, and every cold plan a piece of which went: between its pieces its slot is idle in
        the server, but kept for it (a short turn sent then could take the last slot, and the cold
        request would wait for somebody's whole reply: bench day, bob's first turn 18 s behind a
        translation). With the server's slot count known (`set_layout`), the free slots are the
        rest; when none is, a request that would go now is held instead (it would only queue in
        the server) and they go in arrival order, one per slot that frees, before a cold plan's
        first piece, unless that plan has waited its own time alone since it arrived (rule 4's
        bound): then the slot is its own, but never before one held for a slot whose place is
        before its own. A background job (its purpose, whatever rule 1 judged it) takes its place
        after the chat turns until it has waited `max_hold_s` since it arrived (slot_line.py's
        `place`); a restore waiting goes before them all (rule 14).
        How long each was held so is its record's `slot_wait_ms` (`slot_wait_s`).
    13. A reload (`reconfigure`) rules from then on; held requests are never dropped: with mode
        `off` every plan is released at once.
    14. Restores (keep_kv). A request a kept file holds part of (`Restorable`) is restored before
        it goes: Restore when a slot is free, else it waits for one, up to `max_wait_s`
        (`restores.wait_s`; not at all when computing would cost no more than restoring). The next
        slot to come free is claimed for it: while a restore waits and no slot is free, other
        requests are held behind it (they would queue in the server anyway) until it is sent;
        while a restore runs, all are: llama-server could give a request sent meanwhile the very
        slot being restored, and then runs the restore only after that request's whole reply
        (bench day: eve's restore, with a translation sent as it started, took 17.8 s); and
        after it, until the restored request has started its prompt: sent at once beside it,
        another request could take the restored slot first (bench day: a translation did, and eve
        waited 5.7 s more for another slot); then, until its first token, all but prompts of at
        most a tile, which would share its batch (bench day: a translation's 652 tokens made eve's
        64 take 1.27 s); at most LANDING_MAX_S in all (slot_line.py).
        Restored (`on_restored`), it is decided as if it arrived then, with the estimate the
        restore left (a returning conversation is no longer cold). A restore that found no idle
        slot waits for the next request to finish; one that failed otherwise, or whose wait ran
        out, is decided as it came (computed), with the reason.
    15. Warm-ups (the warm-up queue, proxy/warm/queue.py, decides which and how far) are the lowest
        priority: `warm_load` tells the queue what real requests do (a cold request held or a
        restore waiting stops them; a request just sent pauses them: its prompt starts alone; so
        does every slot taken: sent then, a piece would wait in the server's queue and take the
        next slot to come free before the requests held for one (bench day: `ann`'s warm-up piece
        sent as a held turn took the last slot, waited 4.8 s in llama-server's queue); a piece may
        join a real prompt's batch, adding at most `max_stall_ms`), `warm_sizer` sizes
        their pieces from the same batch cost, and their pieces in flight (`on_warm_pieces`) count
        like a cold request's: a slot, and the one piece in flight (a cold request that arrives
        meanwhile is not on an idle server: it waits for that piece); each teaches the cost. A
        request that ends a warm-up of its conversation (`ramp_from`) ramps its own pieces up from
        the warm-up's largest, a size measured at its prefix beside the same streams (bench day:
        `ann-5`'s rest after her warm-up's pieces of 512-640 tokens went in pieces of 64, 128
        and 256, 3.2 s to her first token).
    16. Saves (keep_kv) are tasks on the server's main loop like a piece: one goes (Save, from
        `on_save_due`) only when the server is quiet (`save_ok`: nothing sent, held, fed, restored
        or warmed), and until `on_save_done` it counts as a slot user and the piece in flight: a
        cold request arriving meanwhile waits for it, restores and warm-ups wait, short requests
        are admitted (the server runs them after the save).
    17. A plan's first piece ends at `Arrived.first_upto` at least (`sizing.first_piece_end`:
        rounded up to a multiple of 64, when that is at most FIRST_PIECE_MAX and a quarter of the
        prompt): llama-server places each piece by its own similarity to the slots, and a short
        first piece that shares the chat template's head with another prompt's slot is put there,
        taking the slot of a plan fed in pieces (bench day: `bob-0`'s 128-token first piece, 23
        tokens shared, took `ann-0`'s slot, and ann's 1,998 tokens cost 2,496-2,624 computed).
        Past the floor it goes where the whole prompt would.
    18. A piece never leaves a rest of under TILE_ROWS tokens (`sizing.absorb_tail`): it takes
        all of it but one token. ggml's CPU flash attention computes a batch of fewer rows one row
        at a time (bench day: `ann-5`'s last 47 tokens, after 2,432 fed, took 733 ms beside three
        streams, a 64-token piece there ~250 ms); one token left is one row, the price of a decode
        token. Pieces end on multiples of 64 and prompts do not, so without this every plan's
        rest was such a batch.
    19. A short turn of under TILE_ROWS new tokens after a long cached history, about to go
        (`trim_short_turns`, any mode but off), is trimmed when that pays the turn, counting the
        whole decode step its trim piece rides in (narrow.py), and so is a longer prompt about
        to go whole whose last micro-batch (`n_ubatch`) would hold under TILE_ROWS rows (bench
        day: a 559-token post-summary rest beside three streams on one shared KV ended in 50
        rows, 1.8 s where 576 tokens took 1.0-1.2): a piece of its prompt goes
        first (a short turn's first `len - TILE_ROWS` ids), so that llama-server keeps only those of
        the slot's cells and the prompt computes its last 64 tokens in one tile, not its few row by row
        (bench day: `dan-0`'s 58 tokens after a 6,016-token restore froze every stream 1.8 s); 65
        while anybody decodes (on a KV per slot one of them may go with the decode token of the slot
        below, and 63 would go row by row: `narrow.trim`). Decode tokens fill the turn's tile
        only on one shared KV (`set_layout`). The row-by-row price is learned from the requests that
        computed such a batch (`on_finished`): none on a GPU, and then nothing is trimmed. Nor is a
        turn whose estimate counts a held reply as cached (`guessed_tokens`) until follow-ups on this
        server were seen to find their reply whole (estimate/replies.py): where the template renders
        it otherwise, the trim piece computes what the estimate missed, row by row when under 64
        tokens (bench day: 7 of 12 trim pieces computed 24-240 tokens, not one). A machine seen to
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
        self._cfg = config
        self._n_batch = n_batch
        self._cost = cost if cost is not None else BatchCostModel()
        self._use = ServerUse()
        self._plans = ColdPlans()  # rules 4-8 (plans.py)
        self._line = SlotLine(slots)  # rules 12 and 14 (slot_line.py)
        self._notes: dict[str, str] = {}  # what happened before a request's release (rule 14)
        self._warm_pieces = 0
        self._saving: str | None = None
        self._shared_kv: bool | None = None
        """One KV pool shared by the slots (`set_layout`; None: not known)."""
        self._trims = Trims()  # rule 19 (trims.py)
        self.save_ms: float | None = None
        """What the last save cost the server's main loop (rule 16)."""
        self._now = 0.0
        """The latest `now` the policy decided at (`_server`'s view of the slot line)."""

    # ---- events ----------------------------------------------------------------------------

    def on_arrival(self, req_id: str, est_new_tokens: int, est_prompt_tokens: int,
                   now: float, restorable: Restorable | None = None, *,
                   first_upto: int = 0, background: bool = False,
                   guessed_tokens: int = 0, ramp_from: int = 0) -> list[Decision]:
        """`first_upto`: where a first piece ends at least (rule 17); `background`: its purpose is
        one of `background_purposes` (rule 1); `guessed_tokens`: of its cached tokens, a held
        reply's not known to be found (rule 19); `ramp_from`: a warm-up's largest piece of its
        prompt (rule 15)."""
        arrived = Arrived(req_id, est_new_tokens, est_prompt_tokens, now, first_upto, background,
                          guessed_tokens, ramp_from)
        wait = (wait_s(self._cost.cost, arrived, restorable, self._n_batch)
                if restorable is not None and restorable.tokens > 0 else 0.0)
        if restorable is not None and wait > 0:
            self._line.restores.add(arrived, restorable, wait)
            return [Hold(req_id, "waiting for a slot to restore its kept KV into"),
                    *self._advance(now)]
        return self._arrive(arrived, now)

    def on_restored(self, req_id: str, est_new_tokens: int, now: float) -> list[Decision]:
        """Its file is in a slot now; `est_new_tokens` are left to compute."""
        waiting = self._line.restores.pop(req_id)
        if waiting is None:
            return []
        req = waiting.req
        decided = self._arrive(Arrived(req_id, est_new_tokens, req.est_prompt_tokens, req.now,
                                       background=req.background, ramp_from=req.ramp_from), now)
        if any(isinstance(d, Admit) and d.req_id == req_id for d in decided):
            self._line.land(req_id, now)
        return [*decided, *self._advance(now)]

    def on_restore_failed(self, req_id: str, reason: str, now: float, *,
                          no_slot: bool = False) -> list[Decision]:
        """`no_slot`: no idle slot was found: it waits for the next request to finish."""
        waiting = self._line.restores.waiting.get(req_id)
        if waiting is None:
            return []
        waiting.running = False
        if no_slot and now < waiting.until:
            waiting.needs_a_finish = True
            return self._advance(now)
        self._line.restores.pop(req_id)
        self._notes[req_id] = f"keep_kv: {reason}, computed instead"
        return [*self._arrive(waiting.req, now), *self._advance(now)]

    def learned(self) -> tuple[list[tuple[Row, float, float]], list[float]]:
        """What it measured of this server: the batch cost's samples and the row-by-row price's
        (prefill/learned.py keeps them across slotwise's restarts)."""
        return self._cost.export(), self._trims.samples()

    def adopt_learned(self, batches: Sequence[tuple[Row, float, float]],
                      narrow: list[float]) -> None:
        """What `learned` gave before a restart, on the same server, as if measured first."""
        self._cost.adopt(batches)
        self._trims.adopt(narrow, self._cost)

    def set_layout(self, slots: int | None, shared_kv: bool | None) -> None:
        """The server's slot count and whether its slots share one KV pool (`/props`, as
        `layout.ServerLayout` reads it), once known."""
        self._line.slots = slots
        self._shared_kv = shared_kv

    def on_prefill_started(self, req_id: str, now: float) -> list[Decision]:
        self._set_phase(req_id, Phase.PREFILLING)
        return self._advance(now) if self._line.prompt_started(req_id) else []

    def on_first_token(self, req_id: str, now: float) -> list[Decision]:
        self._set_phase(req_id, Phase.DECODING)
        landed = self._line.landed(req_id)
        return self._advance(now) if self._plans or landed else []

    def on_finished(self, req_id: str, now: float, prompt_n: int | None = None,
                    prompt_ms: float | None = None, cache_n: int = 0) -> list[Decision]:
        decoders, cells = self._use.decoders(besides=req_id), self._use.cells(besides=req_id)
        if prompt_n is not None and prompt_ms is not None and prompt_n >= LEARN_MIN_TOKENS:
            ub = min(self._n_batch, self._cfg.n_ubatch)
            if ub < TILE_ROWS or last_rows(prompt_n, decoders, self._shared_kv, self._n_batch,
                                           ub) >= TILE_ROWS:  # rule 19: a short last one is not tiled
                self._cost.observe_prefill(prompt_n, cache_n, prompt_ms, self._n_batch, decoders,
                                           cells)
        elif prompt_n is not None and prompt_ms is not None:  # rule 19
            self._trims.learn(self._cost, prompt_n, cache_n, prompt_ms, decoders, cells,
                              self._shared_kv)
        self._line.landed(req_id)
        self._line.waited.pop(req_id, None)  # the gate has read it, if it held the request
        if not self._use.ended(req_id):
            return []
        self._line.restores.a_request_finished()
        return self._advance(now)

    def on_piece_done(self, req_id: str, tokens: int, elapsed_ms: float,
                      now: float) -> list[Decision]:
        trimmed = self._trims.pop(req_id)
        if trimmed is not None:  # rule 19: the turn goes (its piece teaches no cost)
            return [*self._release_trim(trimmed, None, now), *self._advance(now)]
        if not self._plans.piece_done(self._server(), req_id, tokens, elapsed_ms, now):
            return []
        return self._advance(now)

    def on_warm_pieces(self, in_flight: int, now: float) -> list[Decision]:
        """How many warm-up pieces are in flight now (rule 15)."""
        if in_flight == self._warm_pieces:
            return []
        self._warm_pieces = in_flight
        return self._advance(now)

    def on_warm_piece_done(self, tokens: int, ctx: int, elapsed_ms: float) -> None:
        """A warm-up's piece teaches the batch cost like a cold request's (rules 9, 15)."""
        self._cost.observe_piece(tokens, ctx, elapsed_ms, self._use.decoders(), self._use.cells())

    def on_save_due(self, save_id: str, now: float) -> list[Decision]:
        """Rule 16: the keeper has a slot to save; it goes only on a quiet server."""
        if not self.save_ok():
            return []
        self._saving = save_id
        return [Save(save_id)]

    def on_save_done(self, save_id: str, elapsed_ms: float, now: float) -> list[Decision]:
        if self._saving != save_id:
            return []
        self._saving, self.save_ms = None, elapsed_ms
        return self._advance(now)

    def on_piece_failed(self, req_id: str, reason: str, now: float) -> list[Decision]:
        trimmed = self._trims.pop(req_id)
        if trimmed is not None:
            return [*self._release_trim(trimmed, reason, now), *self._advance(now)]
        held = self._plans.held.get(req_id)
        if held is None:
            return []
        held.piece_upto = None
        return [*self._release(held, Forward(req_id, f"piece failed, forwarded as it came: "
                                                     f"{reason}"), now),
                *self._advance(now)]

    def on_client_left(self, req_id: str, now: float) -> list[Decision]:
        self._notes.pop(req_id, None)
        waited = self._line.left(req_id, now)
        held = self._plans.held.pop(req_id, None)
        if held is not None:
            cancel: list[Decision] = [CancelPiece(req_id)] if held.piece_upto is not None else []
            return [*cancel, *self._advance(now)]
        if self._trims.pop(req_id) is not None:
            return [CancelPiece(req_id), *self._advance(now)]
        if not self._use.ended(req_id) and not waited:
            return []
        return self._advance(now)

    def on_tick(self, now: float) -> list[Decision]:
        return self._advance(now)

    def reconfigure(self, config: PrefillConfig, now: float) -> list[Decision]:
        """A reload: the new config rules from now on. Held requests are never dropped: with
        mode `off` every plan is released at once; otherwise they go on under it."""
        self._cfg, self._n_batch = config, config.n_batch
        out: list[Decision] = []
        if config.mode == "off":
            for held in list(self._plans.held.values()):
                out.extend(self._release(held, held.release("prefill.mode off (reload)"), now))
        return [*out, *self._advance(now)]

    # ---- queries ---------------------------------------------------------------------------

    def next_wakeup(self) -> float | None:
        """The earliest `now` at which `on_tick` may decide something (None: only events will)."""
        times = [t for t in (self._line.next_wakeup(), self._plans.next_wakeup(self._server()))
                 if t is not None]
        return min(times, default=None)

    def slot_wait_s(self, req_id: str) -> float:
        """How long the request was held because every slot was in use or claimed (rules 12 and
        14), all told; asked once, when the gate is done with it (the record's `slot_wait_ms`)."""
        return self._line.waited.pop(req_id, 0.0)

    def save_ok(self) -> bool:
        """Rule 16: whether a save may go now (nobody else uses the server)."""
        return not (self._use or self._plans or self._line or self._warm_pieces or self._saving
                    or self._trims)

    def warm_load(self, now: float) -> Load:
        """Rule 15: what real requests are doing, as the warm-up queue decides by it (a save in
        flight pauses it like a request just sent)."""
        grace = self._use.sent_grace_end()
        return Load(cold_held=bool(self._plans or self._line),
                    starting=now < grace or self._saving is not None or bool(self._trims),
                    busy=bool(self._use) or self._saving is not None,
                    no_slot=self._line.full(self._taken()),
                    decoders=self._use.decoders(), cells=self._use.cells(),
                    recheck_at=grace if now < grace else None)

    def warm_sizer(self) -> Sizer:
        """Rule 15: a warm-up's pieces are sized like a cold request's, from the same cost."""
        cfg = self._cfg
        return WarmSizer(self._cost.cost, cfg.max_stall_ms, self._n_batch, cfg.prefill_share)

    def snapshot(self) -> PolicySnapshot:
        active = self._plans.active()
        waiting = tuple(r for r in self._plans if active is None or r != active.req.req_id)
        others = self._line.held()
        return PolicySnapshot(
            mode=self._cfg.mode,
            held=((active.req.req_id,) if active else ()) + waiting + others,
            waiting=waiting,
            chunking=(active.progress(self._plans.next_piece_at) if active and self._cfg.mode == "chunk"
                      else None),
            in_flight=tuple(self._use.phases.items()),
            cost=self._cost.describe(),
            choice=active.choice if active else None,
        )

    # ---- arrivals and releases ---------------------------------------------------------------

    def _arrive(self, req: Arrived, now: float) -> list[Decision]:
        """Rules 1-4 for a request arriving (or back from a restore, or from behind one)."""
        req_id = req.req_id
        background = req.background and not self._slots_scarce()  # rule 1: a slot to spare
        by_tokens = req.est_new_tokens >= self._cfg.cold_tokens
        by_stall = (None if self._cfg.mode == "off" or by_tokens
                    else stall_reason(self._cfg, self._cost, req, self._n_batch,
                                      self._use.streams(), self._use.cells(), background))
        if by_stall is not None and len(self._plans) > self._cfg.max_waiting:
            by_stall = None  # cold by its stall only: sent whole rather than refused
        goes_now = self._cfg.mode == "off" or not (by_tokens or by_stall)
        taken = self._taken()
        if (self._line.claimed(now, taken, req.est_new_tokens)
                or (goes_now and self._line.full(taken))):
            return [Hold(req_id, self._line.hold(req, now))]
        if goes_now:
            if self._cfg.mode == "off":
                return self._admit(req, "prefill.mode off", now)
            return self._trim(req, now) or self._admit(req, "not cold", now)
        idle = not (self._plans or self._use or self._warm_pieces or self._saving)
        if idle and self._cfg.mode == "defer":
            return self._admit(req, "cold, nobody generating", now)
        if self._plans and len(self._plans) > self._cfg.max_waiting:
            self._notes.pop(req_id, None)
            return [Reject(req_id, f"{len(self._plans) - 1} cold requests already waiting "
                                   f"(prefill.max_waiting = {self._cfg.max_waiting})")]
        why = ("nobody generating: fed in pieces back to back" if idle
               else "waiting for its turn" if self._plans else "others generating" if self._use
               else "a warm-up's piece in flight" if self._warm_pieces
               else "a save of kept KV in flight")
        if by_stall is not None:  # the record says why it was cold
            self._notes[req_id] = self._noted(req_id, by_stall)
        self._plans.held[req_id] = HeldRequest.for_request(req, self._cfg.max_hold_s, background)
        decided = self._advance(now)
        if decided and isinstance(decided[0], Admit) and decided[0].req_id == req_id:
            return decided  # released at once (rule 7: short enough to go whole)
        return [Hold(req_id, why), *decided]

    def _trim(self, req: Arrived, now: float) -> list[Decision]:
        """Rule 19: its trim piece, if it pays; else nothing."""
        if not self._cfg.trim_short_turns or req.guessed_tokens:
            return []
        cut = self._trims.cut(self._cost, req, self._use.decoders(), self._use.cells(),
                              self._shared_kv, n_batch=self._n_batch, n_ubatch=self._cfg.n_ubatch)
        if cut is None:
            return []
        self._line.land(req.req_id, now, started=True)
        self._notes[req.req_id] = self._noted(req.req_id, cut.reason())
        return [FeedPiece(req.req_id, cut.upto, trim=True)]

    def _release_trim(self, req: Arrived, failed: str | None, now: float) -> list[Decision]:
        """Rule 19: the trimmed turn goes, its trim piece done (or failed: as it came); the others
        wait for it as after a restore (rule 14): its slot, idle for a moment, holds what it
        needs, and its batch is to be short."""
        self._use.sent(req.req_id, now, req.est_prompt_tokens)
        self._line.land(req.req_id, now)
        if failed is not None:
            self._notes.pop(req.req_id, None)
            return [Forward(req.req_id, f"trim piece failed, forwarded as it came: {failed}")]
        return [Forward(req.req_id, self._notes.pop(req.req_id, "trimmed"))]

    def _admit(self, req: Arrived, reason: str, now: float) -> list[Decision]:
        self._use.sent(req.req_id, now, req.est_prompt_tokens)
        return [Admit(req.req_id, self._noted(req.req_id, reason))]

    def _release(self, held: HeldRequest, decision: Admit | Forward, now: float) -> list[Decision]:
        """End a plan: its request goes upstream and counts as generating from now on."""
        req_id = decision.req_id
        self._plans.held.pop(req_id, None)
        self._use.sent(req_id, now, held.req.est_prompt_tokens)
        reason = self._noted(req_id, decision.reason)
        return [Admit(req_id, reason) if isinstance(decision, Admit) else Forward(req_id, reason)]

    def _noted(self, req_id: str, reason: str) -> str:
        note = self._notes.pop(req_id, None)
        return reason if note is None else f"{note}; {reason}"

    def _set_phase(self, req_id: str, phase: Phase) -> list[Decision]:
        self._use.moved(req_id, phase)
        return []

    # ---- deciding ----------------------------------------------------------------------------

    def _advance(self, now: float) -> list[Decision]:
        """Apply rules 4-7, 12 and 14 until nothing changes: restores take a freed slot first,
        then the requests held for one, then the cold plans."""
        self._now = now
        out: list[Decision] = []
        while True:
            step = [*self._restore_step(now), *self._unclaim(now), *self._plan_step(now)]
            if not step:  # a plan owed a slot may have gone into a hold: the slot is not its now
                step = self._unclaim(now)
            if not step:
                return out
            out.extend(step)

    def _restore_step(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        for waiting in self._line.restores.expired(now):
            self._notes[waiting.req.req_id] = ("keep_kv: no slot came free to restore into "
                                              "in time, computed instead")
            out.extend(self._arrive(waiting.req, now))
        started = self._line.restores.start(0 if self._saving else self._line.free(self._taken()))
        return [*out, *(Restore(r) for r in started)]

    def _unclaim(self, now: float) -> list[Decision]:
        """Rules 12 and 14: the requests held for a slot go in their order (arrival, background
        jobs after the chat turns for a while), one per free slot, once no restore claims it and
        no cold plan is owed it."""
        out: list[Decision] = []
        while True:
            owed = self._plans.slots_owed(self._server(), now)
            behind = self._line.next_behind(now, self._taken() + owed, self._cfg.max_hold_s)
            if behind is None:
                return out
            req, why = behind
            self._notes.setdefault(req.req_id, f"held {why.removeprefix('waiting ')}")
            out.extend(self._arrive(req, now))

    def _plan_step(self, now: float) -> list[Decision]:
        step = self._plans.step(self._server(), now)
        if step is None:
            return []
        if isinstance(step, FeedPiece):
            return [step]
        return self._release(*step, now)

    def _server(self) -> Server:
        """The plans' view, at the last `now` the policy was given (`_advance`)."""
        now = self._now
        return Server(self._cfg, self._n_batch, self._cost, self._use,
                      other_piece=bool(self._warm_pieces or self._saving or self._trims),
                      free_slots=(None if self._line.slots is None
                                  else self._line.free(self._taken())),
                      slot_wanted=bool(self._line),
                      first_held=self._line.first_place(now, self._cfg.max_hold_s), now=now)

    # ---- state -------------------------------------------------------------------------------

    def _slots_scarce(self) -> bool:
        """Rule 1: somebody waits for a slot, or one more slot used would leave none free."""
        return bool(self._line) or (self._line.slots is not None
                                    and self._line.free(self._taken()) <= 1)

    def _taken(self) -> int:
        """Rule 12: the slots used or kept besides the restores running (the line counts those)."""
        return (len(self._use) + self._warm_pieces + (self._saving is not None)
                + self._plans.slots_kept() + len(self._trims))
