"""The replay: the logged requests arrive at their logged times into slotwise's prefill policy and
the server model, one clock for both; what happens becomes their records.

One loop over the clock's timed events (clock.py: arrivals, sends after slotwise's own time, pieces,
clients leaving, the policy's wake-ups, saves of kept KV coming due, warm-up calls) and the server
model's boundaries, always the earlier first; the server runs quiet decode stretches up to the next
event in one go, once the boundary's happenings have placed theirs. Kept KV's restores and saves
are keeping.py's, warm-ups warming.py's (their queue has its turn after every event, as in the
gate's loop). Pure: the clock is simulated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from proxy.estimate.replies import ReplyReuse
from proxy.prefill.events import CancelPiece, FeedPiece, Hold, Reject, Restore, Save
from proxy.record.flight import Flight, Phase, PrefillPlan
from proxy.record.schema import Record
from proxy.report.records import RecordLine
from proxy.whatif.clock import Clock, Wakeups
from proxy.whatif.costs import Costs
from proxy.whatif.flights import Witness
from proxy.whatif.gatekeeper import Action, PolicySeam, Send
from proxy.whatif.keeping import Keeping
from proxy.whatif.loras import LoraPlan, adapters_in, batch_key, explicit
from proxy.whatif.requests import Job, Workload
from proxy.whatif.seed import Seed
from proxy.whatif.server import (
    Failed,
    Finished,
    FirstToken,
    Happening,
    LoopDone,
    ServerModel,
    Started,
)
from proxy.whatif.settings import Settings
from proxy.whatif.slots import Task
from proxy.whatif.warming import Warming
from proxy.whatif.warmjobs import warm_jobs

QUIET_REASONS = ("not cold", "prefill.mode off")
"""Admission reasons the gate leaves out of `policy_note` (proxy/prefill/gate.py)."""


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


@dataclass
class Outcome:
    records: list[Record]
    batches: int
    policy_cost: str | None
    unknown_decisions: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    cache_found: dict[str, int] = field(default_factory=dict)
    """Each request's prompt tokens the server found cached, by id."""
    copied: list[RecordLine] = field(default_factory=list)
    """Records of the log written out as they were (warm-ups it could not replay)."""


class Replay:
    def __init__(self, workload: Workload, settings: Settings, costs: Costs, *,
                 records: bool = True, seed: Seed | None = None) -> None:
        """`seed`: the learned file the config names, read for this server (seed.py)."""
        self.work, self.settings, self.costs = workload, settings, costs
        cfg = settings.config
        self.server = ServerModel(settings.server, costs)
        self.server.preload(workload.before_log, workload.used_before)
        self.witness = Witness(build=records)
        self.warm_plan = warm_jobs(workload.warm_records, workload.jobs,
                                   restored=workload.restored_by_warm_up)
        self.policy = PolicySeam(cfg.prefill, cfg.prefill.n_batch, settings.server.parallel,
                                 shared_kv=settings.server.kv_unified, keep=cfg.keep_kv.enabled,
                                 warm=cfg.warm.enabled and bool(self.warm_plan.jobs))
        self.loras = LoraPlan(cfg.lora, adapters_in(j.record for j in workload.jobs))
        self.clock = Clock()
        self._live: dict[str, _Live] = {}
        self._by_flight: dict[Flight, _Live] = {}
        self._found: dict[str, int] = {}
        self.replies = ReplyReuse()
        """How much of a held reply follow-ups found, learned as the real cache model does: rule
        19 trims no turn whose estimate would count on a reply not known to be found whole."""
        if seed is not None and seed.learned is not None:  # it started the day from its file
            self.policy.adopt(seed.learned)
            self.replies.adopt(seed.learned.replies)
        elif cfg.prefill.learned_file and not (seed is not None and seed.afresh):
            self.policy.start_learned(costs.narrow_per_row_kctx_ms)  # the file not at hand
        self.keeping = Keeping(workload, cfg.keep_kv, self.server, self.policy, self.witness,
                               self._apply)
        self._piece_delay_s = costs.piece_ms / 2000.0
        """slotwise's own time around a piece: half before it reaches the server, half after."""
        self.warming = Warming(cfg, self.server, self.policy, self.witness, self.loras, self._apply,
                               self.clock.at, self._piece_delay_s, self.keeping)
        self.wakeups = Wakeups(self.clock, self.policy.next_wakeup,
                               lambda now: self._apply(self.policy.tick(now), now),
                               self.warming.next_wakeup)
        self.witness.registry.subscribe(self._on_phase)

    def run(self) -> Outcome:
        clock, server = self.clock, self.server
        for job in self.work.jobs:  # requests.py, `Job.after`
            clock.when(job.after, job.arrival, job.think_s, functools.partial(self._arrive, job))
        for warm in self.warm_plan.jobs:  # warmjobs.py, `WarmJob.after`
            clock.when(warm.after, warm.arrival, warm.think_s,
                       functools.partial(self.warming.arrive, warm))
        for save in self.keeping.saves:
            clock.at(save.at, functools.partial(self.keeping.save_due, save))
        while True:
            t_srv = server.next_at
            if t_srv is not None and t_srv <= clock.next_at:
                clock.now = t_srv
                for happening in server.boundary(None):  # what they bring may come sooner
                    self._happened(happening)
            elif clock:
                clock.run_next()
            else:
                break
            if self.keeping.waiting:
                self.keeping.try_saves(clock.now)
            if self.warming.active:
                self.warming.tick(clock.now)
            self.wakeups.schedule()
            server.stretch(clock.next_at)
        notes = [self.loras.note] if self.loras.note else []
        unplaced = self.warm_plan.unplaced
        if unplaced:
            notes.append(f"warm-ups: {len(unplaced)} copied as they were, not replayed (no size "
                         "logged, or no later request of their client): "
                         + ", ".join(str(r.get("id")) for r in unplaced[:5]))
        return Outcome(self.witness.records, server.batches, self.policy.cost_summary(),
                       dict(self.policy.unknown), notes, self._found, list(unplaced))

    # ---- the slotwise side ---------------------------------------------------------------------

    def _arrive(self, job: Job, now: float) -> None:
        lora, rewritten = self.loras.forwarded(job.lora_in)
        flight = self.witness.arrive(job, now, lora, rewritten)
        live = _Live(job, f"{job.id}#{len(self._live) + 1}", flight, lora)
        self._live[live.key] = live
        self._by_flight[flight] = live
        if job.patience_s is not None:
            leaves = job.cut_at if job.cut_at is not None else now + job.patience_s
            self.clock.at(max(now, leaves), lambda t: self._gone(live, t))
        if self.warming.enabled and self.warm_plan.jobs:  # as the gate: before the estimate
            self.warming.claim(job, flight, now, lambda t, ramp: self._estimate(live, t, ramp))
        else:
            self._estimate(live, now)

    def _estimate(self, live: _Live, now: float, ramp_from: int = 0) -> None:
        """The request's estimate, then the policy's say (`ramp_from`: its warm-ups' largest
        piece)."""
        if live.ended:
            return
        job, flight = live.job, live.flight
        if not self.policy.estimates:
            self._apply(self.policy.arrived(live.key, 0, 0, now), now)
            return
        cached = self.server.common(job.prompt)
        # a starved request's size is a guess (requests.py): never cold, so never fed in pieces;
        # sent, it holds its place as the log shows and is never computed
        est_new = 0 if job.starved else job.prompt_tokens - cached
        facts = flight.prefill
        facts.est_prompt_tokens, facts.est_new_tokens = job.prompt_tokens, est_new
        self._apply(self.policy.arrived(live.key, est_new, job.prompt_tokens, now,
                                        self.keeping.restorable(job, cached), flight.purpose,
                                        self.replies.guessed(job.reply[0]), ramp_from), now)

    def _apply(self, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, Save):
                self.keeping.save(action.req_id, now)
                continue
            live = self._live.get(action.req_id)
            if live is None or live.ended:
                continue
            if isinstance(action, Send):
                self._release(live, action, now)
            elif isinstance(action, Hold):
                if live.held_at is None:
                    live.held_at = now
                    live.flight.prefill.plan = PrefillPlan.HELD
                    self.witness.hold(live.flight, now)
            elif isinstance(action, FeedPiece):
                self._feed(live, action.upto_tokens, now, action.trim)
            elif isinstance(action, Reject):
                self._finish(live, now)
                self.witness.rejected(live.flight, action.reason, now)
            elif isinstance(action, CancelPiece) and live.piece is not None:
                self.server.cancel(live.piece, now)
                live.piece = None
            elif isinstance(action, Restore):
                job = live.job
                self.keeping.restore(live.key, job.id, job.prompt, job.kept, now)

    def _release(self, live: _Live, action: Send, now: float) -> None:
        facts = live.flight.prefill
        if live.held_at is not None:
            facts.held_ms = round((now - live.held_at) * 1000.0, 1)
        facts.slot_wait_ms = self.policy.slot_wait_ms(live.key)
        if action.reason not in QUIET_REASONS:
            facts.note = action.reason
        job = live.job
        task = Task(live.key, job.prompt, job.out, job.generated, batch_key(live.lora),
                    explicit(live.lora), starved=job.starved, slot=self.work.slots.get(job.id))
        live.task = task
        self.clock.at(now + job.overhead_s, lambda t: self._send(live, task, t))

    def _send(self, live: _Live, task: Task, now: float) -> None:
        if live.ended:
            return
        self.witness.sent(live.flight, now)
        self.server.submit(task, now)

    def _feed(self, live: _Live, upto: int, now: float, trim: bool) -> None:
        job = live.job
        prompt = job.prompt.prefix(upto)
        piece = Task(live.key, prompt, prompt, 1, batch_key(live.lora), explicit(live.lora))
        live.piece, live.trim = piece, trim
        self.witness.piece_started(live.flight, now)
        self.clock.at(now + self._piece_delay_s, lambda t: self.server.submit(piece, t)
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
        self._apply(self.policy.piece_done(live.key, piece.prompt_n, piece.prompt_ms, now), now)

    def _gone(self, live: _Live, now: float) -> None:
        if live.ended:
            return
        self._finish(live, now)
        if live.piece is not None:
            self.server.cancel(live.piece, now)
        if live.task is not None:
            self.server.cancel(live.task, now)
        self._apply(self.policy.client_left(live.key, now), now)
        if live.task is None:  # it left while held: as the gate writes it then
            live.flight.prefill.slot_wait_ms = self.policy.slot_wait_ms(live.key)
        self.witness.gone(live.flight, live.task, live.job.events, now)

    def _finish(self, live: _Live, now: float) -> None:
        """Its client has what it gets: its next turn comes the client's own time later."""
        live.ended = True
        self.keeping.forget(live.job.id)
        self.clock.ended(live.job.id, now)

    # ---- the server side ------------------------------------------------------------------------

    def _happened(self, happening: Happening) -> None:
        if isinstance(happening, LoopDone):
            self._loop_done(happening)
            return
        task = happening.task
        if self.warming.active and self.warming.owns(task):
            self.warming.happened(happening)
            return
        live = self._live.get(task.key)
        if live is None or live.ended:
            return
        now = happening.t
        if task is live.piece:
            if isinstance(happening, Finished):
                self.clock.at(now + self._piece_delay_s,
                         lambda t: self._piece_back(live, task, t))
            elif isinstance(happening, Failed):
                live.piece = None
            return
        if task is not live.task:
            return
        if isinstance(happening, Started):
            self._found[live.job.id] = task.cache_n
            self.witness.started(live.flight, task, now)
        elif isinstance(happening, FirstToken):
            self.witness.first_token(live.flight, now)
        elif isinstance(happening, Finished):
            self._finish(live, now)
            self.witness.finished(live.flight, task, live.job.events, now)
        elif isinstance(happening, Failed):
            self._finish(live, now)
            self.witness.failed(live.flight, happening.status, happening.error, now)

    def _loop_done(self, done: LoopDone) -> None:
        if done.work.held is None:
            self.keeping.saved(done)
            return
        self.keeping.loop_done(done)
        if self.warming.restoring(done.work.key):
            self.warming.restore_ended(done)
            return
        live = self._live.get(done.work.key)
        if live is not None and not live.ended:
            self.keeping.restored(live.key, live.job, live.flight, done)

    def _on_phase(self, flight: Flight, old: Phase, new: Phase, now: float) -> None:
        """The registry's listener, as the prefill gate's `on_phase`."""
        live = self._by_flight.get(flight)
        if live is None:
            return
        if new is Phase.DONE:
            del self._by_flight[flight]
            self.replies.observe(*live.job.reply)  # as the cache model learns it from cache_n
            prompt_n, total = flight.computed_tokens, flight.prompt_tokens
            timings = flight.timings or {}
            prompt_ms = timings.get("prompt_ms")
            self._apply(self.policy.phase(
                live.key, new, now, prompt_n=prompt_n,
                prompt_ms=float(prompt_ms) if isinstance(prompt_ms, int | float) else None,
                cache_n=max(0, (total or 0) - (prompt_n or 0))), now)
        else:
            self._apply(self.policy.phase(live.key, new, now), now)
