"""The prefill policy: when, and in what pieces, a cold prompt reaches the server.

Pure and synchronous: events in, decisions out; no I/O, no clock (every call takes `now`), no log.
The async gate applies the decisions and reports what happened back as events.
"""

from __future__ import annotations

from collections import deque

from proxy.config import PrefillConfig
from proxy.prefill.batch_cost import BatchCostModel
from proxy.prefill.events import (
    Admit,
    Arrived,
    CancelPiece,
    Decision,
    FeedPiece,
    Forward,
    Hold,
    Reject,
)
from proxy.prefill.held import HeldRequest
from proxy.prefill.outlook import ChunkKnobs, Situation
from proxy.prefill.pacing import idle_piece, pieces_share
from proxy.prefill.sizing import next_upto, pause_s
from proxy.prefill.snapshot import PolicySnapshot
from proxy.prefill.strategy import PieceChoice, Strategy, choose_piece
from proxy.record.flight import Phase

LEARN_MIN_TOKENS = 256
"""A finished request teaches the batch cost only if it computed at least this many tokens. Short
turns are left out: their prompt time is mostly per-request work, and with one shared KV they attend
over other slots' cells the model does not see, so they read as a much cheaper machine than the
one a piece meets (seen: pieces predicted at 85 ms that took 240)."""
SENT_GRACE_S = 0.5
"""Rule 8: a request just sent upstream is about to start its prompt (a stream shows its prefill
only once it starts); the next piece waits for it this long at most, since a non-streamed request
shows nothing until it ends."""


class PrefillPolicy:
    """Decides, per request, Admit / Hold / FeedPiece / Forward / Reject / CancelPiece.

    Rules (tests/test_policy.py follows them one to one):
     1. A request is cold when its estimated new tokens are >= `cold_tokens`. Any other request is
        admitted at once and never waits behind a cold one.
     2. Mode `off`: every request is admitted at once.
     3. Somebody is generating while a request that was sent upstream has not finished (sent,
        prefilling or decoding). A cold request that finds nobody generating and no cold request
        ahead of it is admitted at once (full speed).
     4. One cold request at a time is held or fed in pieces (the active plan). Other cold requests
        wait (Hold) in arrival order; one more than `max_waiting` waiting is rejected.
     5. `defer`: the active cold request is held while others generate and admitted as soon as
        nobody does, or by `on_tick` once it has been held `max_hold_s` since its arrival.
     6. `chunk`: while others generate, the active cold request goes on the way `choose_piece`
        (strategy.py, its own numbered rules) picks from the fitted batch cost at its prefix:
        PIECES or LARGER_PIECES: fed as cumulative token-id prefixes, FeedPiece(upto), starting
        after the tokens already cached; after each piece a pause of piece_time * (1 - share) /
        share (`on_tick` sends the next piece), share = `prefill_share`, or more when the cold
        request would otherwise take over `max_cold_factor` × its time alone. WHOLE (the rest
        fits one piece, or no option beats sending it): the real request is forwarded. HOLD:
        held like `defer` until the hold the strategy chose ends (then forwarded whole), or
        nobody generates (rule 7).
     7. `chunk`: as soon as nobody is generating, the rest goes at full speed: forwarded at once if
        its predicted time is under IDLE_WHOLE × `max_stall_ms`, else fed in pieces of up to
        IDLE_STALL × `max_stall_ms` back to back (in a chat, users pause between turns; one who
        comes back waits for one such piece, not for the whole rest). A piece already in flight is
        let finish first, since its work is kept in the cache.
     8. Short requests that arrive while a cold one is fed are admitted at once (rule 1); the plan
        is unchanged: the next piece still waits for its pause, and also while any other request
        is computing its prompt (PREFILLING) or was sent less than SENT_GRACE_S ago and has not
        started it yet, so that short prompts go between pieces, not into a piece's batch; unless
        the cold request has fallen behind `max_cold_factor` (rule 6's share is 1): then it no
        longer yields (chat users whose turns come one after another would starve it).
     9. The batch cost (batch_cost.py) is learned from every piece (its time at its prefix, with the
        streams decoding beside it) and every finished request's prefill (prompt_n after cache_n
        in prompt_ms, if >= LEARN_MIN_TOKENS); it starts at a conservative prior.
    10. A client that leaves ends its part at once: an active plan ends (CancelPiece if a piece is
        in flight), a waiting request leaves the line, a sent request stops counting as generating.
    11. A failed piece ends the plan: the real request is forwarded as it came (fail open), with
        the reason.
    12. When an active plan ends, the next waiting cold request becomes active and rules 3, 5, 6
        apply to it; the request just released counts as generating.
    13. A reload (`reconfigure`) rules from then on; held requests are never dropped: with mode
        `off` the active one and every waiting one are released at once.
    """

    def __init__(self, config: PrefillConfig, *, n_batch: int = 2048,
                 cost: BatchCostModel | None = None) -> None:
        if n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {n_batch}")
        self._cfg = config
        self._n_batch = n_batch
        self._cost = cost if cost is not None else BatchCostModel()
        self._in_flight: dict[str, Phase] = {}
        self._sent_at: dict[str, float] = {}
        self._line: deque[Arrived] = deque()
        self._held: HeldRequest | None = None

    # ---- events ----------------------------------------------------------------------------

    def on_arrival(self, req_id: str, est_new_tokens: int, est_prompt_tokens: int,
                   now: float) -> list[Decision]:
        if self._cfg.mode == "off":
            return self._admit(req_id, "prefill.mode off", now)
        if est_new_tokens < self._cfg.cold_tokens:
            return self._admit(req_id, "not cold", now)
        if self._held is None and not self._in_flight:
            return self._admit(req_id, "cold, nobody generating", now)
        if self._held is not None and len(self._line) >= self._cfg.max_waiting:
            return [Reject(req_id, f"{len(self._line)} cold requests already waiting "
                                   f"(prefill.max_waiting = {self._cfg.max_waiting})")]
        self._line.append(Arrived(req_id, est_new_tokens, est_prompt_tokens, now))
        why = "waiting for its turn" if self._held is not None else "others generating"
        return [Hold(req_id, why), *self._advance(now)]

    def on_prefill_started(self, req_id: str, now: float) -> list[Decision]:
        return self._set_phase(req_id, Phase.PREFILLING)

    def on_first_token(self, req_id: str, now: float) -> list[Decision]:
        self._set_phase(req_id, Phase.DECODING)
        return self._advance(now) if self._held is not None else []

    def on_finished(self, req_id: str, now: float, prompt_n: int | None = None,
                    prompt_ms: float | None = None, cache_n: int = 0) -> list[Decision]:
        if prompt_n is not None and prompt_ms is not None and prompt_n >= LEARN_MIN_TOKENS:
            self._cost.observe_prefill(prompt_n, cache_n, prompt_ms, self._n_batch,
                                       self._decoders(besides=req_id))
        self._sent_at.pop(req_id, None)
        if self._in_flight.pop(req_id, None) is None:
            return []
        return self._advance(now)

    def on_piece_done(self, req_id: str, tokens: int, elapsed_ms: float,
                      now: float) -> list[Decision]:
        held = self._held
        if held is None or held.req.req_id != req_id or held.piece_upto is None:
            return []
        self._cost.observe_piece(tokens, held.piece_upto - tokens, elapsed_ms, self._decoders())
        held.done_upto, held.piece_upto = held.piece_upto, None
        held.pieces_done += 1
        held.largest_piece = max(held.largest_piece or 0, tokens)
        share = self._share(held, now)
        held.behind = share >= 1.0
        held.next_piece_at = now + pause_s(elapsed_ms / 1000.0, share)
        return self._advance(now)

    def observe_piece(self, tokens: int, ctx: int, elapsed_ms: float) -> None:
        """A piece fed for something else than a held request (a warm-up) teaches the batch cost
        too (rule 9); nothing else changes."""
        self._cost.observe_piece(tokens, ctx, elapsed_ms, self._decoders())

    def on_piece_failed(self, req_id: str, reason: str, now: float) -> list[Decision]:
        held = self._held
        if held is None or held.req.req_id != req_id:
            return []
        return [*self._release(Forward(req_id, f"piece failed, forwarded as it came: {reason}"),
                               now),
                *self._advance(now)]

    def on_client_left(self, req_id: str, now: float) -> list[Decision]:
        held = self._held
        if held is not None and held.req.req_id == req_id:
            self._held = None
            cancel: list[Decision] = [CancelPiece(req_id)] if held.piece_upto is not None else []
            return [*cancel, *self._advance(now)]
        self._line = deque(a for a in self._line if a.req_id != req_id)
        self._sent_at.pop(req_id, None)
        if self._in_flight.pop(req_id, None) is None:
            return []
        return self._advance(now)

    def on_tick(self, now: float) -> list[Decision]:
        return self._advance(now)

    def reconfigure(self, config: PrefillConfig, now: float) -> list[Decision]:
        """A reload: the new config rules from now on. Held requests are never dropped: with
        mode `off` every one of them is released at once; otherwise the plan goes on under it."""
        self._cfg, self._n_batch = config, config.n_batch
        if config.mode != "off":
            return self._advance(now)
        out: list[Decision] = []
        if self._held is not None:
            out.extend(self._release(self._held.release("prefill.mode off (reload)"), now))
        while self._line:
            out.extend(self._admit(self._line.popleft().req_id, "prefill.mode off (reload)", now))
        return out

    # ---- queries ---------------------------------------------------------------------------

    def next_wakeup(self) -> float | None:
        """The earliest `now` at which `on_tick` may decide something (None: only events will)."""
        held = self._held
        if held is None:
            return None
        if self._cfg.mode == "defer":
            return held.deadline
        if held.hold_until is not None:
            return held.hold_until
        if held.behind:
            return None if held.piece_upto is not None else held.next_piece_at
        if held.piece_upto is not None or self._others_prefilling():
            return None  # an event (PieceDone, FirstToken, Finished) moves the plan on
        return max(held.next_piece_at, self._sent_grace_end())

    def choice(self, done_tokens: int, remaining_tokens: int,
               largest_piece: int | None = None) -> PieceChoice:
        """How a cold request at this point would go on now (rule 6), from the fitted cost."""
        knobs = ChunkKnobs(max_stall_ms=self._cfg.max_stall_ms, n_batch=self._n_batch,
                           prefill_share=self._cfg.prefill_share,
                           max_hold_ms=self._cfg.max_hold_s * 1000.0)
        situation = Situation(done_tokens=done_tokens, remaining_tokens=remaining_tokens,
                              decoders=self._decoders(), largest_piece=largest_piece,
                              probe=self._cost.needs_probe())
        return choose_piece(self._cost.cost, situation, knobs)

    def snapshot(self) -> PolicySnapshot:
        held = self._held
        waiting = tuple(a.req_id for a in self._line)
        return PolicySnapshot(
            mode=self._cfg.mode,
            held=((held.req.req_id,) if held else ()) + waiting,
            waiting=waiting,
            chunking=held.progress() if held and self._cfg.mode == "chunk" else None,
            in_flight=tuple(self._in_flight.items()),
            cost=self._cost.describe(),
            choice=held.choice if held else None,
        )

    # ---- internals -------------------------------------------------------------------------

    def _admit(self, req_id: str, reason: str, now: float) -> list[Decision]:
        self._in_flight[req_id] = Phase.QUEUED
        self._sent_at[req_id] = now
        return [Admit(req_id, reason)]

    def _set_phase(self, req_id: str, phase: Phase) -> list[Decision]:
        if req_id in self._in_flight:
            self._in_flight[req_id] = phase
        return []

    def _release(self, decision: Admit | Forward, now: float) -> list[Decision]:
        """End the active plan: its request goes upstream and counts as generating from now on."""
        self._held = None
        self._in_flight[decision.req_id] = Phase.QUEUED
        self._sent_at[decision.req_id] = now
        return [decision]

    def _advance(self, now: float) -> list[Decision]:
        """Apply rules 5-7 and 12 until nothing changes."""
        out: list[Decision] = []
        while True:
            if self._held is None:
                if not self._line:
                    return out
                self._held = HeldRequest.for_request(self._line.popleft(), self._cfg.max_hold_s)
            held = self._held
            out.extend(self._step(held, now))
            if self._held is held:
                return out

    def _step(self, held: HeldRequest, now: float) -> list[Decision]:
        req_id = held.req.req_id
        if self._cfg.mode == "defer":
            if not self._in_flight:
                return self._release(Admit(req_id, "held until others finished"), now)
            if now >= held.deadline:
                return self._release(Admit(req_id, "held prefill.max_hold_s"), now)
            return []
        if held.piece_upto is not None:
            return []
        rest = held.req.est_prompt_tokens - held.done_upto
        if not self._in_flight:
            return self._idle(held, rest, now)
        if held.hold_until is not None:
            if now < held.hold_until:
                return []
            return self._release(held.release("held as the batch cost chose"), now)
        choice = held.choice = self.choice(held.done_upto, rest, held.largest_piece)
        if choice.strategy is Strategy.WHOLE:
            return self._release(held.release(choice.reason), now)
        if choice.strategy is Strategy.HOLD:
            held.hold_until = now + choice.hold_ms / 1000.0
            return []
        if now < held.next_piece_at or (not held.behind and (
                self._others_prefilling() or now < self._sent_grace_end())):
            return []
        held.piece_upto = next_upto(held.done_upto, choice.piece_tokens)
        return [FeedPiece(req_id, held.piece_upto)]

    def _idle(self, held: HeldRequest, rest: int, now: float) -> list[Decision]:
        """Rule 7: nobody generates: the rest whole if it is short, else an idle piece."""
        piece = idle_piece(self._cost.cost, self._cfg, self._n_batch, held, rest)
        if piece is None:
            return self._release(held.release("nobody generating"), now)
        held.piece_upto = next_upto(held.done_upto, piece)
        return [FeedPiece(held.req.req_id, held.piece_upto)]

    def _share(self, held: HeldRequest, now: float) -> float:
        return pieces_share(self._cost.cost, self._cfg, self._n_batch, held, self._decoders(), now)

    def _decoders(self, besides: str | None = None) -> int:
        """Requests decoding now (their tokens share every batch)."""
        return sum(1 for r, phase in self._in_flight.items()
                   if phase is Phase.DECODING and r != besides)

    def _others_prefilling(self) -> bool:
        return any(phase is Phase.PREFILLING for phase in self._in_flight.values())

    def _sent_grace_end(self) -> float:
        """When the last request sent but not yet prefilling stops holding the next piece."""
        return max((self._sent_at[r] + SENT_GRACE_S for r, phase in self._in_flight.items()
                    if phase is Phase.QUEUED), default=0.0)
