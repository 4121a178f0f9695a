"""The replay: the logged requests arrive at their logged times into slotwise's prefill policy and
the server model, one clock for both; what happens becomes their records.

One loop over the clock's timed events (clock.py: arrivals, sends after slotwise's own time, pieces,
clients leaving, the policy's wake-ups, saves of kept KV coming due, warm-up calls) and the server
model's boundaries, always the earlier first; the server runs quiet decode stretches up to the next
event in one go, once the boundary's happenings have placed theirs. The requests' way through the
gate is gating.py's, kept KV's restores and saves keeping.py's, warm-ups warming.py's (their queue
has its turn after every event, as in the gate's loop). Pure: the clock is simulated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from proxy.estimate.replies import ReplyReuse
from proxy.record.schema import Record
from proxy.report.records import RecordLine
from proxy.whatif.clock import Clock, Wakeups
from proxy.whatif.costs import Costs
from proxy.whatif.flights import Witness
from proxy.whatif.gatekeeper import Action, PolicySeam
from proxy.whatif.gating import Gating
from proxy.whatif.keeping import Keeping
from proxy.whatif.loras import LoraPlan, adapters_in
from proxy.whatif.requests import Workload
from proxy.whatif.seed import Seed
from proxy.whatif.server import Happening, LoopDone, ServerModel
from proxy.whatif.settings import Settings
from proxy.whatif.warming import Warming
from proxy.whatif.warmjobs import warm_jobs


@dataclass
class Replayed:
    """What a replay gives: the records the requests would have had, and what it noticed."""

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
        replies = self._seed(seed)
        self.keeping = Keeping(workload, cfg.keep_kv, self.server, self.policy, self.witness,
                               self._apply)
        piece_delay_s = costs.piece_ms / 2000.0  # slotwise's own time around a piece (gating.py)
        self.warming = Warming(cfg, self.server, self.policy, self.witness, self.loras, self._apply,
                               self.clock.at, piece_delay_s, self.keeping)
        self.gating = Gating(workload, self.server, self.policy, self.witness, self.loras,
                             self.clock, self.keeping, self.warming,
                             warm_jobs=bool(self.warm_plan.jobs), replies=replies,
                             piece_delay_s=piece_delay_s)
        self.wakeups = Wakeups(self.clock, self.policy.next_wakeup,
                               lambda now: self.gating.apply(self.policy.tick(now), now),
                               self.warming.next_wakeup)

    def _seed(self, seed: Seed | None) -> ReplyReuse:
        """Starts the policy where the day started, from the learned file the config names, and
        returns the reply reuse, started from it too."""
        replies = ReplyReuse()
        if seed is not None and seed.learned is not None:  # it started the day from its file
            self.policy.adopt(seed.learned)
            replies.adopt(seed.learned.replies)
        elif self.settings.config.prefill.learned_file and not (seed is not None and seed.afresh):
            self.policy.start_learned(self.costs.narrow_per_row_kctx_ms)  # the file not at hand
        return replies

    def run(self) -> Replayed:
        self._place_calls()
        self._play()
        return self._outcome()

    def _place_calls(self) -> None:
        """The logged requests and warm-up calls, and the saves the log shows, on the clock."""
        clock = self.clock
        for job in self.work.jobs:  # requests.py, `Job.after`
            clock.when(job.after, job.arrival, job.think_s, functools.partial(self.gating.arrive, job))
        for warm in self.warm_plan.jobs:  # warmjobs.py, `WarmJob.after`
            clock.when(warm.after, warm.arrival, warm.think_s,
                       functools.partial(self.warming.arrive, warm))
        for save in self.keeping.saves:
            clock.at(save.at, functools.partial(self.keeping.save_due, save))

    def _play(self) -> None:
        """The loop: the next timed event or server boundary, whichever is earlier, then the turns
        of the saves waiting, the warm-up queue and the wake-ups, then a quiet stretch up to the
        next event; until neither has any left."""
        clock, server = self.clock, self.server
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

    def _outcome(self) -> Replayed:
        notes = [self.loras.note] if self.loras.note else []
        unplaced = self.warm_plan.unplaced
        if unplaced:
            notes.append(f"warm-ups: {len(unplaced)} copied as they were, not replayed (no size "
                         "logged, or no later request of their client): "
                         + ", ".join(str(r.get("id")) for r in unplaced[:5]))
        return Replayed(self.witness.records, self.server.batches, self.policy.cost_summary(),
                       dict(self.policy.unknown), notes, self.gating.found, list(unplaced))

    def _apply(self, actions: list[Action], now: float) -> None:
        """The decisions kept KV's and the warm-ups' events drew from the policy."""
        self.gating.apply(actions, now)

    # ---- the server side ------------------------------------------------------------------------

    def _happened(self, happening: Happening) -> None:
        """To its owner: the main loop's work, a warm-up's task, or a request's."""
        if isinstance(happening, LoopDone):
            self._loop_done(happening)
        elif self.warming.active and self.warming.owns(happening.task):
            self.warming.happened(happening)
        else:
            self.gating.happened(happening)

    def _loop_done(self, done: LoopDone) -> None:
        if done.work.held is None:
            self.keeping.saved(done)
            return
        self.keeping.loop_done(done)
        if self.warming.restoring(done.work.key):
            self.warming.restore_ended(done)
        else:
            self.gating.restored(done)
