"""Kept KV (keep_kv) inside the replay: a request the log shows restored arrives with its file
(`Restorable`), the prefill policy decides when it is restored (its rule 14), a warm-up the log
shows restored restores when its queue says (warming.py), and the saves the log shows go when the
policy lets them (its rule 16); all are the server model's main-loop work (its rule 10), and their
records are the keeper's own. The files are the ones the log shows (kept.py), and those the replay
makes: a restore into a slot whose conversation (of `min_tokens` or more) no file holds saves it
first, as the keep store does (its rule 7: `displaced_save`), taking the main loop's time the log's
saves take a token; a later request of that conversation restores it like a logged file, if it
would spare enough. Pure: driven by the replay's clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from proxy.config import KeepKvConfig
from proxy.keep.store import worth_restoring
from proxy.prefill.events import Restorable
from proxy.record.flight import Flight
from proxy.record.kind import Kind
from proxy.whatif.flights import Witness
from proxy.whatif.gatekeeper import Action, PolicySeam
from proxy.whatif.kept import RESTORE_SUFFIX, LoggedSave
from proxy.whatif.prompts import Held, Seq
from proxy.whatif.requests import Job, Workload
from proxy.whatif.server import LoopDone, LoopWork, ServerModel
from proxy.whatif.slots import Slot

Apply = Callable[[list[Action], float], None]

SAVE_MS_PER_TOKEN = 0.1
"""A save where the log shows none to learn from: `bench day` on `-np 4 -kvu`, the small model,
saved 2,894 tokens in 311 ms, 1,532 in 115 and 4,346 in 512 (0.075-0.12 ms a token)."""
RESTORE_MS_PER_TOKEN = 0.02
"""A restore where the log shows none to learn from: the same days restored 4,079 tokens in
26-55 ms and 6,047 in 27-269 ms (the file in the page cache or not)."""


class Keeping:
    def __init__(self, work: Workload, knobs: KeepKvConfig, server: ServerModel,
                 policy: PolicySeam, witness: Witness, apply: Apply) -> None:
        self.enabled = knobs.enabled
        self._work, self._knobs, self._server = work, knobs, server
        self._policy, self._witness, self._apply = policy, witness, apply
        self._due: dict[str, LoggedSave] = {}
        """Saves come due that the policy has not let go yet."""
        self._made: dict[str, Held] = {}
        """Files the replay saved (conversations a restore pushed out of their slot), by name."""
        self._chosen: dict[str, tuple[str, int]] = {}
        """A request's made file and the tokens of its prompt the file holds, by request id."""
        self._displacing: dict[str, tuple[str, int, int, float]] = {}
        """A restore's key: the save run first (file name, tokens, slot, ms)."""
        self._save_ms = _per_token([(s.ms, s.tokens or 0) for s in work.saves], SAVE_MS_PER_TOKEN)
        self._restore_ms = _per_token(
            [(f.restore_ms, j.kept) for j in work.jobs if (f := work.files.get(j.id)) is not None],
            RESTORE_MS_PER_TOKEN)

    @property
    def saves(self) -> list[LoggedSave]:
        """The saves the log shows (none with keep_kv off)."""
        return self._work.saves if self.enabled else []

    @property
    def waiting(self) -> bool:
        return bool(self._due)

    # ---- restores -------------------------------------------------------------------------------

    def restorable(self, job: Job, cached: int) -> Restorable | None:
        """The file this request may restore (its own in the log, or its warm-up's:
        `Workload.file_of`), if it would spare enough now."""
        file = self._work.file_of(job.id)
        spare = self.spare(job.id, job.kept, cached, job.prompt_tokens)
        if file is not None and spare:
            self._chosen.pop(job.id, None)
            return Restorable(spare, file.restore_ms, self._knobs.max_wait_s)
        best = self._made_for(job)
        if best is None or not worth_restoring(best[1], cached, job.prompt_tokens,
                                               self._knobs.min_tokens):
            return None
        self._chosen[job.id] = best
        return Restorable(best[1] - cached, best[1] * self._restore_ms, self._knobs.max_wait_s)

    def _made_for(self, job: Job) -> tuple[str, int] | None:
        """The file the replay made that holds the most of `job`'s prompt, and how much (at most
        all but its last token, as the keep store's `candidate` counts it)."""
        return max(((name, min(held.common(job.prompt), job.prompt_tokens - 1))
                    for name, held in self._made.items()), key=lambda found: found[1], default=None)

    def spare(self, file_id: str, kept: int, cached: int, prompt_tokens: int) -> int:
        """What the file under `file_id` (holding the prompt's first `kept` tokens) would spare
        now, if enough (the keep store's rule 7: `min_tokens` more than is cached, `MOST` of the
        prompt); else 0. For a request, and for a warm-up (the warm-up queue's rule 10)."""
        if not self.enabled or self._work.file_of(file_id) is None or not kept:
            return 0
        return kept - cached if worth_restoring(kept, cached, prompt_tokens,
                                                self._knobs.min_tokens) else 0

    def restore(self, key: str, file_id: str, prompt: Seq, kept: int, now: float) -> None:
        """A restore of the file under `file_id` (the policy's Restore for a request, a warm-up
        queue's RestoreKept): it goes into an idle slot at the next boundary, `LoopDone` under
        `key` when it ends."""
        made = self._chosen.get(file_id)
        if made is not None:
            kept, ms = made[1], made[1] * self._restore_ms
        else:
            file = self._work.file_of(file_id)
            assert file is not None, "restored only when `spare` found its file"
            ms = file.restore_ms
        slot = self._server.table.restore_slot(self._holds, self._server.restoring_into())
        before = self._displaced_save(key, slot)
        self._server.run_on_loop(LoopWork(key, ms, Held(prompt, kept),
                                          None if slot is None else slot.id, before), now)

    def _holds(self, held: Held) -> bool:
        """A file the replay made holds every token of `held`."""
        return any(made.contains(held) for made in self._made.values())

    def _displaced_save(self, key: str, slot: Slot | None) -> float:
        """The keep store's rule 7: the conversation a restore into `slot` would push out, saved
        first when it has `min_tokens` or more and no file holds it; the save's main-loop ms (0:
        none)."""
        if slot is None or slot.held.n < self._knobs.min_tokens or self._holds(slot.held):
            return 0.0
        name = f"displaced-{len(self._made) + 1}"
        self._made[name] = slot.held
        ms = slot.held.n * self._save_ms
        self._displacing[key] = (name, slot.held.n, slot.id, ms)
        return ms

    def restore_ended(self, file_id: str, flight: Flight, kept: int, done: LoopDone) -> bool:
        """A restore for `flight` (a request's or a warm-up's) ended: whether into a slot (its
        record written, named after `file_id`, and the flight's `restored_tokens` set: the `kept`
        tokens the file covered, as the keeper writes them), or with no idle slot to go into."""
        file = self._work.file_of(file_id)
        made = self._chosen.get(file_id)
        if done.slot is None or (file is None and made is None):
            return False  # a made file stays chosen: the policy may restore it again
        self._chosen.pop(file_id, None)
        name: str | None = made[0] if made is not None else file.name if file is not None else None
        kept = made[1] if made is not None else kept
        flight.restored_tokens = kept
        self._witness.kv_call(f"{file_id}{RESTORE_SUFFIX}", done.slot, Kind.KV_RESTORE, name,
                              start=done.t - done.work.ms / 1000.0,
                              end=done.t, client=flight.client, tokens=kept, restored=kept)
        return True

    def loop_done(self, done: LoopDone) -> None:
        """A restore's main-loop work ended, whoever still waits for it: the save run before it
        (`_displaced_save`) gets its record, as the keeper writes it."""
        saved = self._displacing.pop(done.work.key, None)
        if saved is None:
            return
        name, tokens, slot, ms = saved
        start = done.t - (done.work.ms + ms) / 1000.0
        self._witness.kv_call(f"kv-save-{name}", slot, Kind.KV_SAVE, name, start=start,
                              end=start + ms / 1000.0, client=None, tokens=tokens, restored=0)

    def forget(self, request_id: str) -> None:
        """A request ended: a made file it had chosen is no longer waited for."""
        self._chosen.pop(request_id, None)

    def restored(self, key: str, job: Job, flight: Flight, done: LoopDone) -> None:
        """A request's restore ended: in a slot (the request goes on with the rest to compute),
        or with no idle slot to go into (it waits for a request to end)."""
        now = done.t
        if not self.restore_ended(job.id, flight, job.kept, done):
            self._apply(self._policy.restore_failed(key, "no idle slot to restore into", now,
                                                    no_slot=True), now)
            return
        self._apply(self._policy.restored(key, job.prompt_tokens - flight.restored_tokens, now),
                    now)

    # ---- saves ----------------------------------------------------------------------------------

    def save_due(self, save: LoggedSave, now: float) -> None:
        self._due[save.id] = save
        self.try_saves(now)

    def try_saves(self, now: float) -> None:
        """The policy lets one save go at a time, on a quiet server (its rule 16)."""
        for save_id in list(self._due):
            actions = self._policy.save_due(save_id, now)
            if actions:
                self._apply(actions, now)
                return

    def save(self, save_id: str, now: float) -> None:
        """The policy's Save: it runs on the main loop at the next boundary."""
        save = self._due.pop(save_id, None)
        if save is not None:
            self._server.run_on_loop(LoopWork(save_id, save.ms), now)

    def saved(self, done: LoopDone) -> None:
        save = next((s for s in self._work.saves if s.id == done.work.key), None)
        if save is not None:
            self._witness.kv_call(save.id, save.slot, Kind.KV_SAVE, save.name,
                                  start=done.t - save.ms / 1000.0, end=done.t, client=None,
                                  tokens=save.tokens, restored=0)
        self._apply(self._policy.save_done(done.work.key, done.work.ms, done.t), done.t)


def _per_token(samples: list[tuple[float, int]], default: float) -> float:
    """The (lower) median ms a token of (ms, tokens) samples; `default` with none."""
    rates = [ms / tokens for ms, tokens in samples if tokens > 0]
    return statistics.median_low(rates) if rates else default
