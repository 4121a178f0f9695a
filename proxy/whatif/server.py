"""A discrete-event model of llama-server's main loop (`update_slots` in
tools/server/server-context.cpp; llama-server-notes.md section 4). Pure: no clock, no I/O; every
time is passed in or computed, and what happens comes back as values (`Happening`).

Rules (tests/test_whatif_server.py follows them one to one):
 1. Between two batches the queued tasks get slots, in order (slots.py): the idle slot holding the
    largest share of the prompt above `slot_prompt_similarity`, else the least recently used idle
    one; with none idle the task is deferred, and each slot released sends one deferred task back
    to the front of the queue. Where it would take the least recently used slot, a task the
    recording shows in a slot takes that one if it is idle.
 2. The RAM prompt cache (ramcache.py): on the least-recently-used path (or a similar slot that
    would keep under half its tokens) the slot's tokens are saved and the entry that best holds the
    prompt is restored; with `cache_idle_slots` every idle slot is saved at each launch, and
    emptied with one shared KV. Copies take the main loop's time: every slot waits.
 3. A prompt starts when it first enters a batch (a stream's headers): it reuses what its slot
    holds in common with it, one token at least recomputed; a prompt of at least the slot's
    context is refused (400). An explicit LoRA change clears the slot first.
 4. A batch holds one token of each generating slot in slot order (those with the first one's LoRA
    settings), then prompt tokens in slot order up to `n_batch` (checkpointing models stop a
    prompt's batch 4 + n_ubatch and 4 tokens before its end); other LoRA settings wait, and a change
    of settings between batches costs `lora_switch_ms`. A starved task (its log shows it waiting
    until its client left, size unknown) holds its slot and never enters a batch.
 5. A batch takes what stepcost.py says: micro-batches of prompt tokens, or one decode step;
    every token attends to its own slot's cells (with one shared KV every token also scans the
    cells of the KV's span beyond its own, free or another slot's: kvcells.py places each batch's
    cells as llama.cpp does; and decode tokens riding with a prompt pay for theirs at its tile's
    price).
 6. At a batch's end a finished prompt samples its first token and each generating slot its next,
    slot by slot in slot order (a stream in a lower slot than a prompt that just finished has its
    token before that prompt's first token, one in a higher slot after it); a task ends at
    `n_predict` tokens or its slot's context limit, and its slot keeps its prompt and reply.
 7. One shared KV of `ctx` cells: idle slots are emptied when a batch would not fit; if it still
    does not, every task in a slot fails ("Context size has been exceeded.").
 8. A cancelled task leaves the queue at once, or its slot at the next boundary (the slot keeps
    what it computed).
 9. A stretch of decode-only batches with nothing waiting is computed at once, up to the horizon
    (the next outside event) or the batch that finishes a task: the same tokens at the same times
    as batch by batch (with a price on the shared KV's span, every step of it reads the span as at
    its first: what the decoders' own cells move it within a stretch is left out).
10. Kept KV (keep_kv): a restore of a file and a save of a slot are tasks the main loop runs
    between two batches, in the order they came, each taking its time while every slot waits. A
    restore goes into the idle slot the keep store chose (`LoopWork.into`), after the save of its
    conversation slotwise runs first, if any (`before_ms`); if that slot is busy by then, into
    an empty idle one, else the least recently used (the save's time is spent all the same),
    which then holds the file's tokens (what it held before is gone); with no idle slot it does
    nothing. The batch after one is never a quiet stretch (rule
    9): what it lets go is sent in reply to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proxy.whatif.costs import Costs
from proxy.whatif.kvcells import KvCells
from proxy.whatif.prompts import Held, Seq
from proxy.whatif.settings import ServerSettings
from proxy.whatif.slots import Phase, Slot, Slots, Task
from proxy.whatif.stepcost import PromptRun, batch_ms, decode_steps_ms

CONTEXT_EXCEEDED = "Context size has been exceeded."
SEND_ORDER_S = 1e-6
"""Between two slots' tokens at one batch's end, the last slot's at the end: only their order
matters (rule 6), and the next batch starts after all of them."""


@dataclass(frozen=True, slots=True)
class Started:
    task: Task
    t: float


@dataclass(frozen=True, slots=True)
class FirstToken:
    task: Task
    t: float


@dataclass(frozen=True, slots=True)
class Finished:
    task: Task
    t: float


@dataclass(frozen=True, slots=True)
class Failed:
    task: Task
    t: float
    status: int
    error: str


@dataclass(eq=False)
class LoopWork:
    """A restore or a save (rule 10): `ms` of the main loop; `held`: a restore's tokens."""

    key: str
    ms: float
    held: Held | None = None
    into: int | None = None
    """A restore: the slot chosen for it, if still idle then (else the model chooses again)."""
    before_ms: float = 0.0
    """A restore: the main loop's time of a save of that slot's conversation, run first."""


@dataclass(frozen=True, slots=True)
class LoopDone:
    work: LoopWork
    t: float
    slot: int | None
    """The slot restored into; None for a save, or a restore that found no idle slot."""


TaskHappening = Started | FirstToken | Finished | Failed
"""What happens to a task."""
Happening = TaskHappening | LoopDone


@dataclass
class _Batch:
    start: float
    end: float
    runs: list[tuple[Slot, int]]
    decoders: list[Slot]
    work: LoopWork | None = None
    """Not a batch: a restore or a save the main loop runs (rule 10)."""
    slot: int | None = None


class ServerModel:
    def __init__(self, settings: ServerSettings, costs: Costs) -> None:
        self.settings, self.costs = settings, costs
        self.table = Slots(settings, costs)
        self.slots = self.table.slots
        self.kv = KvCells(settings.ctx) if settings.kv_unified else None
        self._batch: _Batch | None = None
        self._wake: float | None = None
        self._lora = "default"
        self._loop: list[LoopWork] = []
        self._unstretched = False
        """The batch just built is quiet and waits for `stretch`."""
        self.batches = 0

    # ---- the outside -----------------------------------------------------------------------

    def preload(self, seqs: list[Seq], used_before: list[int] | None = None) -> None:
        self.table.preload(seqs)
        self.table.used_before(used_before or [])

    def submit(self, task: Task, now: float) -> None:
        self.table.queue.append(task)
        if self._batch is None and self._wake is None:
            self._wake = now

    def restoring_into(self) -> set[int]:
        """The slots restores queued or running on the main loop were chosen for."""
        works = [*self._loop, *([self._batch.work] if self._batch and self._batch.work else [])]
        return {w.into for w in works if w.held is not None and w.into is not None}

    def run_on_loop(self, work: LoopWork, now: float) -> None:
        """Rule 10: a restore or a save, run at the next boundary (`LoopDone` when it ends)."""
        self._loop.append(work)
        if self._batch is None and self._wake is None:
            self._wake = now

    def cancel(self, task: Task, now: float) -> None:
        if self.table.cancel(task) and self._batch is None and self._wake is None:
            self._wake = now

    @property
    def next_at(self) -> float | None:
        """When the next boundary is (the batch in flight ends, or work came to an idle server)."""
        return self._batch.end if self._batch is not None else self._wake

    def common(self, prompt: Seq) -> int:
        return self.table.common(prompt)

    def boundary(self, horizon: float | None) -> list[Happening]:
        """The batch in flight ends (or work came): its tokens, releases, restores and saves,
        queued tasks, the next batch. Quiet decode steps that end before `horizon` are run at
        once; None: the caller first acts on what happened (which may bring work sooner than any
        event it knew of), then calls `stretch`."""
        now = self.next_at
        if now is None:
            return []
        out: list[Happening] = []
        batch, self._batch, self._wake = self._batch, None, None
        looped = batch is not None and batch.work is not None
        if batch is not None and batch.work is not None:
            out.append(LoopDone(batch.work, now, batch.slot))
        elif batch is not None:
            self._post_decode(batch, out)
        if self._loop:  # rule 10: a restore or a save, before any queued task or batch
            work = self._loop.pop(0)
            slot = self.table.restore(work.held, work.into) if work.held is not None else None
            self._batch = _Batch(now, now + (work.before_ms + work.ms) / 1000.0, [], [], work,
                                 None if slot is None else slot.id)
            return out
        spent_ms = self.table.assign(now)
        self._batch = self._build(now + spent_ms / 1000.0, out)
        if self._batch is None and self.table.queue:
            self._wake = now + spent_ms / 1000.0
        elif self._batch is not None and not looped and self._quiet(self._batch):
            # after a restore, one step: what it lets go (its request) is sent in reply to it
            if horizon is None:
                self._unstretched = True
            else:
                self._run_decode(self._batch, horizon)
        return out

    def stretch(self, horizon: float) -> None:
        """`boundary(None)`'s quiet decode steps, now that the caller knows its next event."""
        batch, wanted, self._unstretched = self._batch, self._unstretched, False
        if wanted and batch is not None and self._quiet(batch):
            self._run_decode(batch, horizon)

    # ---- one batch ---------------------------------------------------------------------------

    def _build(self, start: float, out: list[Happening]) -> _Batch | None:
        gens = [s for s in self.slots if s.phase is Phase.GEN and s.task is not None]
        leader = gens[0].task.lora if gens and gens[0].task else None
        decoders = [s for s in gens if s.task is not None and s.task.lora == leader]
        budget = self.settings.n_batch - len(decoders)
        runs: list[tuple[Slot, int]] = []
        for slot in self.slots:
            task = slot.task
            if budget <= 0:
                break
            if task is None or task.starved or slot.phase not in (Phase.STARTED, Phase.PROMPT):
                continue
            if leader is not None and task.lora != leader:
                continue
            if slot.phase is Phase.STARTED and not self._start(slot, task, start, out):
                continue
            take = self._take(task, budget)
            runs.append((slot, take))
            budget -= take
            leader = task.lora if leader is None else leader
        if not runs and not decoders:
            return None
        if not self._fits(runs, decoders, start, out):
            return self._build(start, out)
        ms = self._time(runs, decoders)
        if leader is not None and leader != self._lora:
            ms += self.costs.lora_switch_ms
            self._lora = leader
        self.batches += 1
        return _Batch(start, start + ms / 1000.0, runs, decoders)

    def _start(self, slot: Slot, task: Task, now: float, out: list[Happening]) -> bool:
        limit = self.settings.n_ctx_slot
        if limit and task.prompt.length >= limit:
            out.append(Failed(task, now, 400, f"request ({task.prompt.length} tokens) exceeds the "
                                              f"available context size ({limit} tokens)"))
            slot.task = None  # released; it keeps what it held
            self.table.release(slot, now)
            return False
        n_past = min(slot.held.common(task.prompt), task.prompt.length - 1)
        task.cache_n = task.done = max(0, n_past)
        task.t_start = now
        slot.held = Held(task.prompt, task.done)
        slot.phase = Phase.PROMPT
        out.append(Started(task, now))
        return True

    def _take(self, task: Task, budget: int) -> int:
        left = task.prompt.length - task.done
        take = min(budget, left)
        if self.settings.checkpoints:  # the batch stops 4 + n_ubatch and 4 tokens before the end
            for stop in (4 + self.settings.n_ubatch, 4):
                cut = task.prompt.length - stop
                if task.done < cut:
                    return max(1, min(take, cut - task.done))
        return take

    def _fits(self, runs: list[tuple[Slot, int]], decoders: list[Slot], now: float,
              out: list[Happening]) -> bool:
        """One shared KV of `ctx` cells: idle slots are purged to make room; if that is not enough,
        every processing slot fails (llama-server: "Context size has been exceeded.")."""
        ctx = self.settings.ctx
        if not ctx or not self.settings.kv_unified:
            return True
        need = sum(s.held.n for s in self.slots) + len(decoders) + sum(n for _, n in runs)
        for slot in self.slots:
            if need <= ctx:
                return True
            if slot.phase is Phase.IDLE and slot.held.n:
                need -= slot.held.n
                slot.held = Held()
        if need <= ctx:
            return True
        for slot in self.slots:
            if slot.task is not None:
                out.append(Failed(slot.task, now, 500, CONTEXT_EXCEEDED))
                slot.task.cancelled = True
                slot.held = Held()
                self.table.release(slot, now)
                slot.held = Held()
        return False

    def _time(self, runs: list[tuple[Slot, int]], decoders: list[Slot]) -> float:
        dec_ctx = [s.held.n for s in decoders]
        scanned = self._place(runs, decoders)
        span = self.kv.span() if self.kv is not None else 0
        below = {s.id + 1 for s in decoders} if not self.settings.kv_unified else set()
        prompt = [PromptRun(n, s.held.n, max(0, span - s.held.n - n), chained=s.id in below)
                  for s, n in runs]
        return batch_ms(self.costs, dec_ctx, prompt, n_ubatch=self.settings.n_ubatch,
                        unified=self.settings.kv_unified, scanned=scanned)

    def _place(self, runs: list[tuple[Slot, int]], decoders: list[Slot]) -> int:
        """Rule 5: the batch's cells placed in the shared KV (what the slots hold first: a slot
        emptied, restored or cut back since), and the cells of its span the decode tokens read
        beyond their own."""
        if self.kv is None:
            return 0
        self.kv.sync({s.id: s.held.n for s in self.slots})
        for slot in decoders:
            self.kv.place(slot.id, 1)
        for slot, n in runs:
            self.kv.place(slot.id, n)
        return self._scanned(decoders)

    def _scanned(self, decoders: list[Slot]) -> int:
        """The span's cells beyond each decoder's own (its step's token placed too)."""
        span = self.kv.span() if self.kv is not None else 0
        return sum(max(0, span - s.held.n - 1) for s in decoders) if span else 0

    def _post_decode(self, batch: _Batch, out: list[Happening]) -> None:
        runs = dict(batch.runs)
        decoding = set(batch.decoders)
        for slot in self.slots:
            task, t = slot.task, self._sent(batch.end, slot)
            if task is None:
                continue
            if slot in runs and slot.phase is Phase.PROMPT:
                task.done += runs[slot]
                slot.held = Held(task.prompt, task.done)
                if task.done >= task.prompt.length:
                    slot.phase = Phase.GEN
                    out.append(FirstToken(task, t))
                    self._token(slot, task, t, out)
            elif slot in decoding and slot.phase is Phase.GEN:
                slot.held = Held(task.out, slot.held.n + 1)
                self._token(slot, task, t, out)

    def _sent(self, end: float, slot: Slot) -> float:
        """When `slot`'s token of the batch ending at `end` is sent (rule 6: in slot order)."""
        return end - SEND_ORDER_S * (len(self.slots) - 1 - slot.id)

    def _token(self, slot: Slot, task: Task, t: float, out: list[Happening]) -> None:
        task.n_gen += 1
        task.tokens.append(t)
        limit = self.settings.n_ctx_slot
        task.truncated = bool(limit) and slot.held.n + 1 >= limit
        if task.n_gen >= task.n_predict or task.truncated:
            out.append(Finished(task, t))
            self.table.release(slot, t)

    # ---- quiet decode stretches ----------------------------------------------------------------

    def _quiet(self, batch: _Batch) -> bool:
        return (not batch.runs and not self.table.queue and not self._loop
                and all(s.phase in (Phase.IDLE, Phase.GEN) for s in self.slots)
                and not any(s.task is not None and s.task.cancelled for s in self.slots))

    def _run_decode(self, batch: _Batch, horizon: float) -> None:
        """Steps that end before `horizon` and finish nobody are taken now; the next one is left
        in flight (its end is the next boundary)."""
        decoders = batch.decoders
        left = []
        limit = self.settings.n_ctx_slot
        for slot in decoders:
            assert slot.task is not None
            left.append(slot.task.n_predict - slot.task.n_gen)
            if limit:
                left.append(limit - 1 - slot.held.n)
        steps = min(left)
        if steps <= 1 or batch.end >= horizon:
            return
        attended = sum(s.held.n for s in decoders)
        growth = len(decoders)
        times = decode_steps_ms(self.costs, len(decoders), attended + growth, growth, steps - 1,
                                self._scanned(decoders))
        ends = batch.end + np.cumsum(times) / 1000.0
        taken = min(steps - 1, 1 + int(np.searchsorted(ends, horizon, side="left")))
        stamps = [batch.end, *ends[:taken - 1].tolist()]
        for slot in decoders:
            task = slot.task
            assert task is not None
            task.tokens.extend(self._sent(t, slot) for t in stamps)
            task.n_gen += taken
            slot.held = Held(task.out, slot.held.n + taken)
        self.batches += taken
        batch.start, batch.end = stamps[-1], float(ends[taken - 1])
