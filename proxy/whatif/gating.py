"""The logged requests inside the replay, served as the prefill gate serves them: each arrives, is
estimated and told to the policy; the policy's decisions (send, hold, feed a piece, reject, restore,
save) become the server model's tasks; what the server does with them, and the registry's phase
changes, go back to the policy and into the request's record. Pure: driven by the replay's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.estimate.replies import ReplyReuse
from proxy.prefill.deciding import QUIET_REASONS
from proxy.prefill.events import CancelPiece, FeedPiece, Hold, Reject, Restore, Save
from proxy.record.flight import Flight, Phase, PrefillPlan
from proxy.whatif.clock import Clock
from proxy.whatif.flights import Witness
from proxy.whatif.gatekeeper import Action, PolicySeam, Send
from proxy.whatif.keeping import Keeping
from proxy.whatif.loras import LoraPlan, batch_key, explicit
from proxy.whatif.requests import Job, Workload
from proxy.whatif.server import Failed, Finished, FirstToken, LoopDone, ServerModel, Started, TaskHappening
from proxy.whatif.slots import Task
from proxy.whatif.warming import Warming


@dataclass(eq=False)
class _Live:
    job: Job
    key: str
    flight: Flight
    lora: Any
    task: Task | None = None
    piece: Task | None = None
    trim: bool = False
    """Its piece in flight is a trim (the prefill policy's rule 19)."""
    held_at: float | None = None
    ended: bool = False


class Gating:
    def __init__(self, work: Workload, server: ServerModel, policy: PolicySeam, witness: Witness,
                 loras: LoraPlan, clock: Clock, keeping: Keeping, warming: Warming, *,
                 warm_jobs: bool, replies: ReplyReuse, piece_delay_s: float) -> None:
        """`warm_jobs`: the log shows warm-up calls to replay."""
        self._work, self._server, self._policy, self._witness = work, server, policy, witness
        self._loras, self._clock, self._keeping, self._warming = loras, clock, keeping, warming
        self._claims = warming.enabled and warm_jobs
        """Whether an arrival claims its conversation's warm-ups first, as the gate's `warm` hook."""
        self.replies = replies
        """How much of a held reply follow-ups found, learned as the real cache model does: rule
        19 trims no turn whose estimate would count on a reply not known to be found whole."""
        self._piece_delay_s = piece_delay_s
        """slotwise's own time around a piece: half before it reaches the server, half after."""
        self._live: dict[str, _Live] = {}
        self._by_flight: dict[Flight, _Live] = {}
        self.found: dict[str, int] = {}
        """Each request's prompt tokens the server found cached, by id."""
        witness.registry.subscribe(self._on_phase)

    # ---- a request's way through the gate --------------------------------------------------------

    def arrive(self, job: Job, now: float) -> None:
        lora, rewritten = self._loras.forwarded(job.lora_in)
        flight = self._witness.arrive(job, now, lora, rewritten)
        live = _Live(job, f"{job.id}#{len(self._live) + 1}", flight, lora)
        self._live[live.key] = live
        self._by_flight[flight] = live
        if job.patience_s is not None:
            leaves = job.cut_at if job.cut_at is not None else now + job.patience_s
            self._clock.at(max(now, leaves), lambda t: self._gone(live, t))
        if self._claims:  # as the gate: before the estimate
            self._warming.claim(job, flight, now, lambda t, ramp: self._estimate(live, t, ramp))
        else:
            self._estimate(live, now)

    def _estimate(self, live: _Live, now: float, ramp_from: int = 0) -> None:
        """The request's estimate, then the policy's say (`ramp_from`: its warm-ups' largest
        piece)."""
        if live.ended:
            return
        job, flight = live.job, live.flight
        if not self._policy.estimates:
            self.apply(self._policy.arrived(live.key, 0, 0, now), now)
            return
        cached = self._server.common(job.prompt)
        # a starved request's size is a guess (requests.py): never cold, so never fed in pieces;
        # sent, it holds its place as the log shows and is never computed
        est_new = 0 if job.starved else job.prompt_tokens - cached
        facts = flight.prefill
        facts.est_prompt_tokens, facts.est_new_tokens = job.prompt_tokens, est_new
        self.apply(self._policy.arrived(live.key, est_new, job.prompt_tokens, now,
                                        self._keeping.restorable(job, cached), flight.purpose,
                                        self.replies.guessed(job.reply[0]), ramp_from), now)

    def apply(self, actions: list[Action], now: float) -> None:
        """The policy's decisions, whoever told it what made them."""
        for action in actions:
            if isinstance(action, Save):
                self._keeping.save(action.req_id, now)
                continue
            live = self._live.get(action.req_id)
            if live is None or live.ended:
                continue
            if isinstance(action, Send):
                self._release(live, action, now)
            elif isinstance(action, Hold):
                self._hold(live, now)
            elif isinstance(action, FeedPiece):
                self._feed(live, action.upto_tokens, now, action.trim)
            elif isinstance(action, Reject):
                self._finish(live, now)
                self._witness.rejected(live.flight, action.reason, now)
            elif isinstance(action, CancelPiece) and live.piece is not None:
                self._server.cancel(live.piece, now)
                live.piece = None
            elif isinstance(action, Restore):
                job = live.job
                self._keeping.restore(live.key, job.id, job.prompt, job.kept, now)

    def _hold(self, live: _Live, now: float) -> None:
        if live.held_at is None:
            live.held_at = now
            live.flight.prefill.plan = PrefillPlan.HELD
            self._witness.hold(live.flight, now)

    def _release(self, live: _Live, action: Send, now: float) -> None:
        facts = live.flight.prefill
        if live.held_at is not None:
            facts.held_ms = round((now - live.held_at) * 1000.0, 1)
        facts.slot_wait_ms = self._policy.slot_wait_ms(live.key)
        if action.reason not in QUIET_REASONS:
            facts.note = action.reason
        job = live.job
        task = Task(live.key, job.prompt, job.out, job.generated, batch_key(live.lora),
                    explicit(live.lora), starved=job.starved, slot=self._work.slots.get(job.id))
        live.task = task
        self._clock.at(now + job.overhead_s, lambda t: self._send(live, task, t))

    def _send(self, live: _Live, task: Task, now: float) -> None:
        if live.ended:
            return
        self._witness.sent(live.flight, now)
        self._server.submit(task, now)

    def _feed(self, live: _Live, upto: int, now: float, trim: bool) -> None:
        job = live.job
        prompt = job.prompt.prefix(upto)
        piece = Task(live.key, prompt, prompt, 1, batch_key(live.lora), explicit(live.lora))
        live.piece, live.trim = piece, trim
        self._witness.piece_started(live.flight, now)
        self._clock.at(now + self._piece_delay_s, lambda t: self._server.submit(piece, t)
                       if live.piece is piece else None)

    def _piece_back(self, live: _Live, piece: Task, now: float) -> None:
        if live.piece is not piece or live.ended:
            return
        live.piece = None
        facts = live.flight.prefill
        if live.trim:  # the policy's rule 19: no piece fed ahead (gate.py's `_piece`)
            facts.plan = PrefillPlan.TRIMMED
        else:
            facts.plan, facts.pieces = PrefillPlan.CHUNKED, facts.pieces + 1
            facts.fed_tokens += piece.prompt_n
        self.apply(self._policy.piece_done(live.key, piece.prompt_n, piece.prompt_ms, now), now)

    def _gone(self, live: _Live, now: float) -> None:
        if live.ended:
            return
        self._finish(live, now)
        if live.piece is not None:
            self._server.cancel(live.piece, now)
        if live.task is not None:
            self._server.cancel(live.task, now)
        self.apply(self._policy.client_left(live.key, now), now)
        if live.task is None:  # it left while held: as the gate writes it then
            live.flight.prefill.slot_wait_ms = self._policy.slot_wait_ms(live.key)
        self._witness.gone(live.flight, live.task, live.job.events, now)

    def _finish(self, live: _Live, now: float) -> None:
        """Its client has what it gets: its next turn comes the client's own time later."""
        live.ended = True
        self._keeping.forget(live.job.id)
        self._clock.ended(live.job.id, now)

    # ---- what the server did ----------------------------------------------------------------------

    def happened(self, happening: TaskHappening) -> None:
        """A request's task or piece started, gave its first token, finished or failed."""
        task = happening.task
        live = self._live.get(task.key)
        if live is None or live.ended:
            return
        if task is live.piece:
            self._piece_happened(live, task, happening)
        elif task is live.task:
            self._task_happened(live, task, happening)

    def _piece_happened(self, live: _Live, piece: Task, happening: TaskHappening) -> None:
        """Its piece is back after slotwise's own time, or gone."""
        if isinstance(happening, Finished):
            self._clock.at(happening.t + self._piece_delay_s,
                           lambda t: self._piece_back(live, piece, t))
        elif isinstance(happening, Failed):
            live.piece = None

    def _task_happened(self, live: _Live, task: Task, happening: TaskHappening) -> None:
        now = happening.t
        if isinstance(happening, Started):
            self.found[live.job.id] = task.cache_n
            self._witness.started(live.flight, task, now)
        elif isinstance(happening, FirstToken):
            self._witness.first_token(live.flight, now)
        elif isinstance(happening, Finished):
            self._finish(live, now)
            self._witness.finished(live.flight, task, live.job.events, now)
        elif isinstance(happening, Failed):
            self._finish(live, now)
            self._witness.failed(live.flight, happening.status, happening.error, now)

    def restored(self, done: LoopDone) -> None:
        """A request's restore of a kept file ended on the server's main loop."""
        live = self._live.get(done.work.key)
        if live is not None and not live.ended:
            self._keeping.restored(live.key, live.job, live.flight, done)

    def _on_phase(self, flight: Flight, old: Phase, new: Phase, now: float) -> None:
        """The registry's listener, as the prefill gate's `on_phase`."""
        live = self._by_flight.get(flight)
        if live is None:
            return
        if new is Phase.DONE:
            del self._by_flight[flight]
            self._done(live, flight, now)
        else:
            self.apply(self._policy.phase(live.key, new, now), now)

    def _done(self, live: _Live, flight: Flight, now: float) -> None:
        """The reply reuse and the policy learn what its prompt found cached and cost."""
        self.replies.observe(*live.job.reply)  # as the cache model learns it from cache_n
        prompt_n, total = flight.computed_tokens, flight.prompt_tokens
        timings = flight.timings or {}
        prompt_ms = timings.get("prompt_ms")
        self.apply(self._policy.phase(
            live.key, Phase.DONE, now, prompt_n=prompt_n,
            prompt_ms=float(prompt_ms) if isinstance(prompt_ms, int | float) else None,
            cache_n=max(0, (total or 0) - (prompt_n or 0))), now)
