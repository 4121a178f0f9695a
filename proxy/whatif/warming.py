"""Warm-ups inside the replay: the log's warm-up calls (warmjobs.py) go to slotwise's own
`WarmQueue`, ticked under the load and piece sizes the prefill policy gives (its rule 15) as the
gate's loop ticks it; their pieces are the server model's tasks, told to the policy (a slot user
and the piece in flight while they run, a batch its cost learns from when they end); a real request
of a warm-up's conversation ends it after its piece in flight and is credited with its work (the
queue's rule 7); a warm-up the log shows restored a kept file restores it when the queue says (its
rule 10), on the server model's main loop through keeping.py, in flight like a piece (keep_kv on in
the what-if; off, it computes); each warm-up's record is the warmer's own. Pure: driven by the
replay's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.config import Config
from proxy.record.flight import Flight
from proxy.request.errors import TooManyWarmUps, WarmOff
from proxy.warm.queue import WarmQueue
from proxy.warm.record import warm_flight
from proxy.warm.values import (
    CancelWarmPiece,
    Ended,
    Feed,
    RestoreKept,
    WarmDecision,
    WarmRefused,
    WarmUp,
    warm_knobs,
)
from proxy.whatif.flights import Witness, text_or_none
from proxy.whatif.gatekeeper import Action, PolicySeam
from proxy.whatif.keeping import Keeping
from proxy.whatif.loras import LoraPlan, batch_key, explicit
from proxy.whatif.prompts import token_ids
from proxy.whatif.requests import Job
from proxy.whatif.server import Failed, Finished, LoopDone, ServerModel, TaskHappening
from proxy.whatif.slots import Task
from proxy.whatif.warmjobs import WarmJob

Apply = Callable[[list[Action], float], None]
At = Callable[[float, Callable[[float], None]], None]
Resume = Callable[[float], None]
Credited = Callable[[float, int], None]
"""Goes on with a real request at a time, given its warm-ups' largest piece (`Credit`)."""


@dataclass(eq=False)
class _Warm:
    job: WarmJob
    flight: Flight
    lora: object
    piece: Task | None = None
    waiting: list[Resume] = field(default_factory=list)
    """Real requests of its conversation waiting for its piece or restore in flight to end."""


class Warming:
    def __init__(self, config: Config, server: ServerModel, policy: PolicySeam, witness: Witness,
                 loras: LoraPlan, apply: Apply, at: At, piece_delay_s: float,
                 keeping: Keeping) -> None:
        self.enabled = config.warm.enabled
        """Whether warm-ups are served (off: each call is refused, as the route refuses it)."""
        self.queue = WarmQueue()
        self._knobs = warm_knobs(config.warm, config.prefill)
        self._server, self._policy, self._witness, self._loras = server, policy, witness, loras
        self._apply_policy, self._at = apply, at
        self._delay = piece_delay_s
        """slotwise's own time around a piece (half before it reaches the server, half after)."""
        self._keeping = keeping
        self._warms: dict[str, _Warm] = {}
        self._restores: dict[str, _Warm] = {}
        """Warm-ups whose restore of a kept file is on the main loop, by id (also one that ended
        meanwhile)."""

    @property
    def active(self) -> bool:
        return bool(self._warms)

    # ---- the calls --------------------------------------------------------------------------------

    def arrive(self, job: WarmJob, now: float) -> None:
        rec = job.record
        flight = warm_flight(job.id, str(rec.get("endpoint") or ""), now=now, wall=now,
                             config_gen=1, client=job.client, purpose=text_or_none(rec.get("purpose")),
                             node=text_or_none(rec.get("node")))
        lora, _ = self._loras.forwarded(job.lora_in)
        try:
            if not self.enabled:
                raise WarmOff("warm-ups are off (warm.enabled = false in slotwise's config)")
            self.queue.check_room(job.client, self._knobs)
            ids = token_ids(job.prefix)
            cached = min(len(ids), self._server.common(job.prefix))
            restorable = self._keeping.spare(job.id, job.kept, cached, len(ids))
            warm = WarmUp(id=job.id, client=job.client, ids=ids, submitted=now, cached=cached,
                          restorable=restorable)
            decisions = self.queue.submit(warm, self._knobs, now)
        except WarmRefused as exc:
            self._witness.warm_refused(flight, TooManyWarmUps(str(exc)), now)
            return
        except WarmOff as exc:
            self._witness.warm_refused(flight, exc, now)
            return
        self._warms[job.id] = _Warm(job, flight, lora)
        self._decided(decisions, now)

    def claim(self, job: Job, flight: Flight, now: float, resume: Credited) -> None:
        """A real request arrived: the warm-ups of its conversation end (after their piece in
        flight) and it is credited with their work; then `resume` goes on with it (the estimate)."""
        if not self.queue.claimable():
            resume(now, 0)
            return
        ids = token_ids(job.prompt)
        decisions, wait = self.queue.claim(ids, now)
        self._decided(decisions, now)
        pieces = [w for w in (self._warms.get(i) for i in wait)
                  if w is not None and (w.piece or self.restoring(w.job.id))]

        def credited(t: float) -> None:
            credit = self.queue.credit(ids)
            flight.warmed_tokens, flight.warm_ids = credit.tokens, list(credit.warm_ids)
            resume(t, credit.largest_piece)

        if not pieces:
            credited(now)
            return
        left = len(pieces)

        def piece_ended(t: float) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                credited(t)

        for warm in pieces:
            warm.waiting.append(piece_ended)

    # ---- the gate's loop ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """The queue's turn, under what the policy says real requests do."""
        if not self._warms:
            return
        self._sync(now)
        self._decided(self.queue.on_tick(self._policy.warm_load(now), self._policy.warm_sizer(),
                                         self._knobs, now), now)
        self._sync(now)

    def next_wakeup(self, now: float) -> float | None:
        if not self._warms:
            return None
        return self.queue.next_wakeup(self._policy.warm_load(now), self._knobs, now)

    def owns(self, task: Task) -> bool:
        warm = self._warms.get(task.key)
        return warm is not None and warm.piece is task

    def happened(self, happening: TaskHappening) -> None:
        """A server happening of one of its pieces (`owns`)."""
        task, now = happening.task, happening.t
        warm = self._warms[task.key]
        if isinstance(happening, Finished):
            self._at(now + self._delay, lambda t: self._piece_back(warm, task, t))
        elif isinstance(happening, Failed):
            warm.piece = None
            self._decided(self.queue.on_piece_failed(warm.job.id, happening.error, now), now)
            self._resume(warm, now)

    def restoring(self, key: str) -> bool:
        """Whether a main-loop work under `key` is one of its restores."""
        return key in self._restores

    def restore_ended(self, done: LoopDone) -> None:
        """Its restore ended (`restoring`): the queue goes on after what the file held, or
        computes it all when no slot was idle to take it."""
        warm, now = self._restores.pop(done.work.key), done.t
        job = warm.job
        into_slot = self._keeping.restore_ended(job.id, warm.flight, job.kept, done)
        if job.id in self._warms:  # not ended meanwhile (cancelled: the restore ran all the same)
            if not into_slot:
                self._decided(self.queue.on_restore_failed(job.id, now), now)
            else:
                self._decided(self.queue.on_restored(job.id, self._server.common(job.prefix), now),
                              now)
        self._resume(warm, now)
        self._sync(now)

    # ---- applying decisions ----------------------------------------------------------------------

    def _decided(self, decisions: list[WarmDecision], now: float) -> None:
        for decision in decisions:
            warm = self._warms.get(decision.warm_id)
            if warm is None:
                continue
            if isinstance(decision, Feed):
                self._feed(warm, decision.upto, now)
            elif isinstance(decision, CancelWarmPiece) and warm.piece is not None:
                self._server.cancel(warm.piece, now)
                warm.piece = None
                self._resume(warm, now)
            elif isinstance(decision, RestoreKept):  # in flight like a piece until it ends
                self._restores[warm.job.id] = warm
                self._keeping.restore(warm.job.id, warm.job.id, warm.job.prefix, warm.job.kept, now)
            elif isinstance(decision, Ended):
                self._end(warm, now)

    def _feed(self, warm: _Warm, upto: int, now: float) -> None:
        if warm.flight.timer.prefill_started is None:  # others' records see its prefill
            warm.flight.timer.prefill_started = now
            self._witness.registry.start_prefill(warm.flight, now)
        prompt = warm.job.prefix.prefix(upto)
        piece = Task(warm.job.id, prompt, prompt, 1, batch_key(warm.lora), explicit(warm.lora))
        warm.piece = piece
        self._at(now + self._delay, lambda t: self._server.submit(piece, t)
                 if warm.piece is piece else None)

    def _piece_back(self, warm: _Warm, piece: Task, now: float) -> None:
        if warm.piece is not piece:
            return
        warm.piece = None
        warm.flight.timer.prefill_done = now
        batch_ms = piece.prompt_ms
        self._policy.warm_piece_done(piece.prompt_n, piece.cache_n, batch_ms)
        self._decided(self.queue.on_piece_done(warm.job.id, piece.prompt_n, batch_ms,
                                               self._knobs, now), now)
        self._resume(warm, now)
        self._sync(now)

    def _resume(self, warm: _Warm, now: float) -> None:
        waiting, warm.waiting = warm.waiting, []
        for resume in waiting:
            resume(now)

    def _sync(self, now: float) -> None:
        """Tell the policy how many pieces (and restores, in flight like one) are in flight."""
        in_flight = len(self._restores) + sum(w.piece is not None for w in self._warms.values())
        self._apply_policy(self._policy.warm_pieces(in_flight, now), now)

    def _end(self, warm: _Warm, now: float) -> None:
        if warm.piece is not None:  # ended with its piece cancelled (rule 9)
            self._server.cancel(warm.piece, now)
            warm.piece = None
        self._warms.pop(warm.job.id, None)
        ended = self.queue.warmups.get(warm.job.id)
        if ended is not None:  # the queue keeps an ended warm-up a while (its rule 8)
            self._witness.warm_ended(warm.flight, ended, now)
        self._resume(warm, now)
        self._sync(now)
