"""llama-server's slots between two batches (`process_single_task`, `get_available_slot`,
`launch_slot_with_task`, `release` in tools/server/server-context.cpp): which slot a queued task
gets, what the RAM prompt cache copies meanwhile, what a released slot keeps. Pure; the rules are
the server model's 1, 2 and 8 (server.py).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from proxy.whatif.costs import Costs
from proxy.whatif.prompts import Held, Seq
from proxy.whatif.ramcache import PromptCache
from proxy.whatif.settings import ServerSettings


class Phase(enum.Enum):
    IDLE = 0
    STARTED = 1
    PROMPT = 2
    GEN = 3


@dataclass(eq=False)
class Task:
    """A completion task: a request, or a piece (`n_predict` 1: one token sampled, then it ends)."""

    key: str
    prompt: Seq
    out: Seq
    n_predict: int
    lora: str = "default"
    explicit_lora: bool = False
    cache_n: int = 0
    done: int = 0
    n_gen: int = 0
    t_start: float | None = None
    tokens: list[float] = field(default_factory=list)
    cancelled: bool = False
    truncated: bool = False
    starved: bool = False
    """It never enters a batch (a request the log shows waiting until its client left)."""
    slot: int | None = None
    """The slot the server gave it in the recording: taken if idle (rule 1)."""

    @property
    def prompt_n(self) -> int:
        return self.prompt.length - self.cache_n

    @property
    def prompt_ms(self) -> float:
        """From its start to its first token (0 before either): the server's `prompt_ms`, and a
        piece's batch."""
        if not self.tokens or self.t_start is None:
            return 0.0
        return (self.tokens[0] - self.t_start) * 1000.0


@dataclass(eq=False)
class Slot:
    id: int
    phase: Phase = Phase.IDLE
    task: Task | None = None
    held: Held = field(default_factory=Held)
    t_last: float = -1.0
    released: int = 0
    """Releases before its last one, all slots counted: of two slots released at the end of the
    same batch, the lower one (released first, in slot order) is the least recently used."""
    lora: str | None = None
    """The explicit LoRA settings of its last task (a different one clears its cache)."""


class Slots:
    """The slots, the task queue, the deferred tasks and the RAM prompt cache."""

    def __init__(self, settings: ServerSettings, costs: Costs) -> None:
        self.settings, self.costs = settings, costs
        self.slots = [Slot(i) for i in range(settings.parallel)]
        self.cache = PromptCache(settings.cache_ram, costs.kv_bytes_per_token)
        self.queue: deque[Task] = deque()
        self.deferred: deque[Task] = deque()
        self._releases = 0

    def preload(self, seqs: list[Seq]) -> None:
        """Sequences held before the log began: in the RAM cache, else in empty slots."""
        for seq in seqs:
            held = Held(seq, seq.length)
            if not self.cache.save(held):
                empty = next((s for s in self.slots if s.held.n == 0), None)
                if empty is not None:
                    empty.held = held

    def used_before(self, ids: list[int]) -> None:
        """Slots used before the log began, oldest first: more recently used than a slot never
        used (t_last -1), less than any in the log."""
        for order, sid in enumerate(ids):
            if 0 <= sid < len(self.slots):
                self.slots[sid].t_last = float(order)

    def cancel(self, task: Task) -> bool:
        """Rule 8: a queued task disappears; True if it runs in a slot (released later)."""
        task.cancelled = True
        for line in (self.queue, self.deferred):
            if task in line:
                line.remove(task)
        return any(s.task is task for s in self.slots)

    def common(self, prompt: Seq) -> int:
        """The most tokens of `prompt` an idle slot or the RAM cache holds (an exact estimate)."""
        idle = (s.held.common(prompt) for s in self.slots if s.phase is Phase.IDLE)
        return max(max(idle, default=0), self.cache.common(prompt))

    def restore_slot(self, kept: Callable[[Held], bool] = lambda held: False,
                     taken: Collection[int] = ()) -> Slot | None:
        """The idle slot a restore of a kept file goes into, as the keep store chooses it (its
        rule 7): none another restore was chosen for (`taken`), an empty one first, then one whose
        conversation a file holds (`kept`: a file the replay made), then the one holding the fewest
        tokens, then the least recently used; None when there is none. (The store also passes
        over a slot a request in flight would be given, its conversation's or its warm-up's, and
        chooses a warm-up's slot last; the model does neither.)"""
        idle = [s for s in self.slots if s.phase is Phase.IDLE and s.id not in taken]
        if not idle:
            return None
        return min(idle, key=lambda s: (s.held.n > 0, not kept(s.held), s.held.n, s.t_last,
                                        s.released))

    def restore(self, held: Held, into: int | None = None) -> Slot | None:
        """The server model's rule 10: a kept file into slot `into` if it is idle, else into an
        empty idle one, else the least recently used (slotwise primes it so that the request
        keeps it: no LoRA switch clears it); None when every slot is busy."""
        chosen = next((s for s in self.slots if s.id == into and s.phase is Phase.IDLE), None)
        slot = chosen or self.restore_slot()
        if slot is not None:
            slot.held, slot.lora = held, None
        return slot

    def assign(self, now: float) -> float:
        """Between two batches: cancelled tasks leave their slots, queued tasks get slots (rules 1,
        2). Returns the main loop's time spent copying to and from the RAM cache, in ms."""
        for slot in self.slots:
            if slot.task is not None and slot.task.cancelled:
                self.release(slot, now)
        saved = loaded = 0
        while self.queue:
            task = self.queue.popleft()
            if task.cancelled:
                continue
            chosen, copies = self._select(task)
            saved, loaded = saved + copies[0], loaded + copies[1]
            if chosen is None:
                self.deferred.append(task)
                continue
            self._launch(chosen, task)
            if self.settings.cache_idle_slots and self.cache.enabled:
                for idle in self.slots:
                    if idle.phase is Phase.IDLE:
                        saved += self.cache.save(idle.held)
                        if self.settings.kv_unified:
                            idle.held = Held()
        per_token_ms = self.costs.kv_bytes_per_token / 1e6
        return per_token_ms * (saved / self.costs.save_gb_s + loaded / self.costs.copy_gb_s)

    def _select(self, task: Task) -> tuple[Slot | None, tuple[int, int]]:
        """`get_available_slot`: the best similar idle slot, else the least recently used one;
        on the latter (or a similar one that keeps under half its tokens) the RAM cache is used.
        The least recently used is the slot the recording gave the task, if it is idle. Also the
        tokens copied into the RAM cache and back."""
        idle = [s for s in self.slots if s.phase is Phase.IDLE]
        if not idle:
            return None, (0, 0)
        chosen, update = None, True
        sps = self.settings.slot_prompt_similarity
        recorded = [s for s in idle if s.id == task.slot]
        if sps > 0:
            best = 0.0
            for slot in idle:
                if slot.held.n > 0:
                    sim = slot.held.common(task.prompt) / task.prompt.length
                    if sim > best and sim > sps:
                        best, chosen = sim, slot
            if chosen is not None:
                update = best * task.prompt.length / chosen.held.n < 0.5
        if chosen is None:
            chosen = recorded[0] if recorded else min(reversed(idle),
                                                      key=lambda s: (s.t_last, s.released))
        saved = loaded = 0
        if update and self.cache.enabled:
            saved = self.cache.save(chosen.held)
            entry = self.cache.load(chosen.held, task.prompt)
            if entry is not None:
                chosen.held, loaded = entry, entry.n
        return chosen, (saved, loaded)

    def _launch(self, slot: Slot, task: Task) -> None:
        if task.explicit_lora and slot.lora is not None and slot.lora != task.lora:
            slot.held = Held()  # lora_should_clear_cache: an explicit switch recomputes
        if task.explicit_lora:
            slot.lora = task.lora
        slot.phase, slot.task = Phase.STARTED, task

    def release(self, slot: Slot, now: float) -> None:
        task = slot.task
        if task is not None:
            kept = task.done + max(0, task.n_gen - 1) if task.n_gen else task.done
            slot.held = Held(task.out if task.n_gen else task.prompt, kept)
        slot.phase, slot.task, slot.t_last = Phase.IDLE, None, now
        self._releases += 1
        slot.released = self._releases
        if self.deferred:
            self.queue.appendleft(self.deferred.popleft())
