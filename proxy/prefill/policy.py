"""The prefill policy: when, and in what pieces, a cold prompt reaches the server.

Pure and synchronous: events in, decisions out; no I/O, no clock (every call takes `now`), no log.
The async gate applies the decisions and reports what happened back as events.
"""

from __future__ import annotations

from collections import deque

from proxy.config import PrefillConfig
from proxy.prefill.events import (
    Admit,
    Arrived,
    CancelPiece,
    ClientLeft,
    Decision,
    Event,
    FeedPiece,
    Finished,
    FirstToken,
    Forward,
    Hold,
    PieceDone,
    PieceFailed,
    PrefillStarted,
    Reject,
    Tick,
)
from proxy.prefill.plan import Plan
from proxy.prefill.sizing import (
    DEFAULT_PREFILL_TPS,
    PrefillRate,
    next_upto,
    pause_s,
    piece_tokens,
)
from proxy.prefill.snapshot import Phase, PolicySnapshot

LEARN_MIN_TOKENS = 256
"""A finished request teaches the prefill rate only if it computed at least this many tokens."""
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
     6. `chunk`: while others generate, the active cold request is fed as cumulative token-id
        prefixes: FeedPiece(upto) with pieces of P = min(n_batch, rate * max_stall_ms / 1000)
        tokens (rounded down to 64, at least 64), starting after the tokens already cached. After
        each piece comes a pause of piece_time * (1 - share) / share (`on_tick` sends the next
        piece). Once the rest is <= P tokens the real request is forwarded.
     7. `chunk`: as soon as nobody is generating, the real request is forwarded at once (full
        speed); a piece already in flight is let finish first, since its work is kept in the cache.
     8. Short requests that arrive while a cold one is fed are admitted at once (rule 1); the plan
        is unchanged: the next piece still waits for its pause, and also while any other request
        is computing its prompt (PREFILLING) or was sent less than SENT_GRACE_S ago and has not
        started it yet, so that short prompts go between pieces, not into a piece's batch.
     9. The prefill rate is learned from PieceDone (tokens / elapsed) and from finished requests'
        prompt_n / prompt_ms (if >= 256 tokens); it starts at a conservative default.
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
                 default_tps: float = DEFAULT_PREFILL_TPS) -> None:
        if n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {n_batch}")
        self._cfg = config
        self._n_batch = n_batch
        self._rate = PrefillRate(default_tps)
        self._in_flight: dict[str, Phase] = {}
        self._sent_at: dict[str, float] = {}
        self._line: deque[Arrived] = deque()
        self._plan: Plan | None = None

    # ---- events ----------------------------------------------------------------------------

    def handle(self, event: Event) -> list[Decision]:
        """Dispatch an event value to its `on_*` method."""
        match event:
            case Arrived():
                return self.on_arrival(event.req_id, event.est_new_tokens,
                                       event.est_prompt_tokens, event.now)
            case PrefillStarted():
                return self.on_prefill_started(event.req_id, event.now)
            case FirstToken():
                return self.on_first_token(event.req_id, event.now)
            case Finished():
                return self.on_finished(event.req_id, event.now, event.prompt_n, event.prompt_ms)
            case PieceDone():
                return self.on_piece_done(event.req_id, event.tokens, event.elapsed_ms, event.now)
            case PieceFailed():
                return self.on_piece_failed(event.req_id, event.reason, event.now)
            case ClientLeft():
                return self.on_client_left(event.req_id, event.now)
            case Tick():
                return self.on_tick(event.now)

    def on_arrival(self, req_id: str, est_new_tokens: int, est_prompt_tokens: int,
                   now: float) -> list[Decision]:
        if self._cfg.mode == "off":
            return self._admit(req_id, "prefill.mode off", now)
        if est_new_tokens < self._cfg.cold_tokens:
            return self._admit(req_id, "not cold", now)
        if self._plan is None and not self._in_flight:
            return self._admit(req_id, "cold, nobody generating", now)
        if self._plan is not None and len(self._line) >= self._cfg.max_waiting:
            return [Reject(req_id, f"{len(self._line)} cold requests already waiting "
                                   f"(prefill.max_waiting = {self._cfg.max_waiting})")]
        self._line.append(Arrived(req_id, est_new_tokens, est_prompt_tokens, now))
        held = "waiting for its turn" if self._plan is not None else "others generating"
        return [Hold(req_id, held), *self._advance(now)]

    def on_prefill_started(self, req_id: str, now: float) -> list[Decision]:
        return self._set_phase(req_id, Phase.PREFILLING)

    def on_first_token(self, req_id: str, now: float) -> list[Decision]:
        self._set_phase(req_id, Phase.DECODING)
        return self._advance(now) if self._plan is not None else []

    def on_finished(self, req_id: str, now: float, prompt_n: int | None = None,
                    prompt_ms: float | None = None) -> list[Decision]:
        if prompt_n is not None and prompt_ms is not None:
            self._rate.observe(prompt_n, prompt_ms, min_tokens=LEARN_MIN_TOKENS)
        self._sent_at.pop(req_id, None)
        if self._in_flight.pop(req_id, None) is None:
            return []
        return self._advance(now)

    def on_piece_done(self, req_id: str, tokens: int, elapsed_ms: float,
                      now: float) -> list[Decision]:
        plan = self._plan
        if plan is None or plan.req.req_id != req_id or plan.piece_upto is None:
            return []
        self._rate.observe(tokens, elapsed_ms)
        plan.done_upto, plan.piece_upto = plan.piece_upto, None
        plan.pieces_done += 1
        plan.next_piece_at = now + pause_s(elapsed_ms / 1000.0, self._cfg.prefill_share)
        return self._advance(now)

    def on_piece_failed(self, req_id: str, reason: str, now: float) -> list[Decision]:
        plan = self._plan
        if plan is None or plan.req.req_id != req_id:
            return []
        return [*self._release(Forward(req_id, f"piece failed, forwarded as it came: {reason}"),
                               now),
                *self._advance(now)]

    def on_client_left(self, req_id: str, now: float) -> list[Decision]:
        plan = self._plan
        if plan is not None and plan.req.req_id == req_id:
            self._plan = None
            cancel: list[Decision] = [CancelPiece(req_id)] if plan.piece_upto is not None else []
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
        if self._plan is not None:
            out.extend(self._release(self._plan.release("prefill.mode off (reload)"), now))
        while self._line:
            out.extend(self._admit(self._line.popleft().req_id, "prefill.mode off (reload)", now))
        return out

    # ---- queries ---------------------------------------------------------------------------

    def next_wakeup(self) -> float | None:
        """The earliest `now` at which `on_tick` may decide something (None: only events will)."""
        plan = self._plan
        if plan is None:
            return None
        if self._cfg.mode == "defer":
            return plan.deadline
        if plan.piece_upto is not None or self._others_prefilling():
            return None  # an event (PieceDone, FirstToken, Finished) moves the plan on
        return max(plan.next_piece_at, self._sent_grace_end())

    @property
    def piece_tokens(self) -> int:
        return piece_tokens(self._rate.tps, self._cfg.max_stall_ms, self._n_batch)

    def snapshot(self) -> PolicySnapshot:
        plan = self._plan
        waiting = tuple(a.req_id for a in self._line)
        return PolicySnapshot(
            mode=self._cfg.mode,
            held=((plan.req.req_id,) if plan else ()) + waiting,
            waiting=waiting,
            chunking=plan.progress() if plan and self._cfg.mode == "chunk" else None,
            in_flight=tuple(self._in_flight.items()),
            prefill_tps=self._rate.tps,
            rate_samples=self._rate.samples,
            piece_tokens=self.piece_tokens,
        )

    # ---- internals -------------------------------------------------------------------------

    def _admit(self, req_id: str, reason: str, now: float) -> list[Decision]:
        self._in_flight[req_id] = Phase.SENT
        self._sent_at[req_id] = now
        return [Admit(req_id, reason)]

    def _set_phase(self, req_id: str, phase: Phase) -> list[Decision]:
        if req_id in self._in_flight:
            self._in_flight[req_id] = phase
        return []

    def _release(self, decision: Admit | Forward, now: float) -> list[Decision]:
        """End the active plan: its request goes upstream and counts as generating from now on."""
        self._plan = None
        self._in_flight[decision.req_id] = Phase.SENT
        self._sent_at[decision.req_id] = now
        return [decision]

    def _advance(self, now: float) -> list[Decision]:
        """Apply rules 5-7 and 12 until nothing changes."""
        out: list[Decision] = []
        while True:
            if self._plan is None:
                if not self._line:
                    return out
                self._plan = Plan.for_request(self._line.popleft(), self._cfg.max_hold_s)
            plan = self._plan
            out.extend(self._step(plan, now))
            if self._plan is plan:
                return out

    def _step(self, plan: Plan, now: float) -> list[Decision]:
        req_id = plan.req.req_id
        if self._cfg.mode == "defer":
            if not self._in_flight:
                return self._release(Admit(req_id, "held until others finished"), now)
            if now >= plan.deadline:
                return self._release(Admit(req_id, "held prefill.max_hold_s"), now)
            return []
        if plan.piece_upto is not None:
            return []
        if not self._in_flight:
            return self._release(plan.release("nobody generating"), now)
        piece = self.piece_tokens
        if plan.req.est_prompt_tokens - plan.done_upto <= piece:
            return self._release(plan.release("rest fits one piece"), now)
        if now < plan.next_piece_at or self._others_prefilling() or now < self._sent_grace_end():
            return []
        plan.piece_upto = next_upto(plan.done_upto, piece)
        return [FeedPiece(req_id, plan.piece_upto)]

    def _others_prefilling(self) -> bool:
        return any(phase is Phase.PREFILLING for phase in self._in_flight.values())

    def _sent_grace_end(self) -> float:
        """When the last request sent but not yet prefilling stops holding the next piece."""
        return max((self._sent_at[r] + SENT_GRACE_S for r, phase in self._in_flight.items()
                    if phase is Phase.SENT), default=0.0)
