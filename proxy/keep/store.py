"""The keep store: where each conversation's KV is (a slot, llama-server's RAM cache, a file), which
files to keep, and what to save, restore and delete. Pure: no I/O, no clock, no log; times are wall
clock seconds passed in, decisions are values (`values.py`) the `Keeper` applies.

Rules (tests/test_keep_store.py has one class per rule):
1. Identity. A request that ended leaves a conversation: its prompt's block-hash chain and LoRA
   settings, named by `file_name`. A prompt shorter than `min_tokens` is placed like any other (so
   a restore that pushes it out of its slot tells the cache model, rule 8) but never saved; a newer
   request of the same prompt replaces the older entry.
2. Placement. At each read of `/slots`, a conversation being placed goes to the idle slot that holds
   between its prompt and its prompt + generated tokens (the newest task among several); one placed
   earlier whose slot shows another task or token count left it (RAM). One not found within
   `PLACE_WITHIN_S` left its slot too. A warm-up's prefix is placed the same way, in the idle slot
   holding exactly its tokens, and is there until that slot shows another task or token count. It
   is no conversation (never saved, never a file, a slot no known conversation explains for rule
   7), but rule 7's `wanted` sees it.
3. Restart. A slot whose task went back, or vanished, means llama-server restarted: no conversation
   is in a slot or its RAM cache any more (those without a file are forgotten), and the cache model
   must forget (ForgetCache); those that ended since the last read ran on the restarted server,
   and are placed as usual.
4. Save. When nothing is in flight and no save runs, the conversation idle longest among those idle
   for `save_after_idle_s`, whose idle slot still shows its task and tokens and which no file holds
   whole yet, is saved: SaveSlot(its slot). A busy slot is never saved. One whose save failed, or
   whose file the budget deleted at once, is not tried again (until a request of it ends anew).
5. Saved. A save that holds other tokens than its slot did (the slot changed meanwhile) is deleted.
   Otherwise its file supersedes every file of the same variant whose chain it extends (deleted),
   and the budget runs.
6. Budget. Files not used for `max_age_s`, then beyond `max_files` or `max_bytes`, are deleted, least
   recently used first (`budget.py`); a file larger than the whole budget goes at once.
7. Restore. A request whose prompt a file of this model and variant covers for at least `MOST` of
   its tokens, sparing at least `min_tokens` more than the estimate finds cached, is restored into
   an idle slot no save or restore is using, the one of least loss: an empty one first, then one
   whose conversation a file holds, then of the conversations known in a slot the one holding the
   fewest tokens, then the oldest task (an unsaved conversation is saved first, a stall of its
   size for every stream, 0.6-1.0 s for 6,877 tokens on the testbed where the 1,532 of another
   idle slot took 0.18 s), a slot whose tokens no known conversation explains last (a warm-up's
   prefix for a turn about to come, a request not yet placed: bench day, `eve`'s restore took the
   slot of `ann`'s warm-up, 1,856 tokens, and her turn computed 2,472). Among slots of equal loss,
   one whose KV the request will keep goes first (`keeps_restored_kv`: llama-server clears a slot's
   cache for a request whose explicit `lora` differs from the slot's last one, and for a slot that
   never had a task); any other is primed first (`prime`: a one-token task with the request's
   `lora`), which costs far less than any conversation pushed out (bench day, `-np 5`: `dan`'s
   restore took the slot of `cho`'s 676 tokens rather than prime a never-used one, and `cho`'s
   next turn computed 728 tokens whole, every stream frozen 0.66 s). Never one llama-server would
   give another request in flight by its prompt similarity (`wanted`: the slot of its own
   conversation, most often; restored into, the restore would wait there for that request's whole
   reply: bench day, `eve`'s restore into the slot `bob`'s trim piece was sent to took 25.8 s), nor
   the slot of a warm-up's prefix a request in flight continues (bench day, `eve`'s restore took
   the one idle slot, where `ann`'s warm-up had just computed 1,400 tokens for the turn she had
   sent 70 ms before, and that turn computed 2,472 tokens: 6.0 s to its first token).
   No such slot: no restore now
   (the prefill policy's rule 14 waits for the next slot to come free). A conversation no file
   holds in the slot it takes (of at least `min_tokens`) is saved first (`displaced_save`), one
   save at a time: a save costs a stall of about a second, recomputing it tens of seconds
   (llama-server's own slot choice would have copied it to its RAM cache; a restore does not).
   What it still displaces is counted (`displaced_tokens`): its next turn computes it again. A
   request whose conversation is being saved, holding more of it than any file (a block or more),
   waits for that save to end and restores its file (`saving_spares`).
8. Restored. A restore marks its file used; its conversation is in that slot now, and the one there
   before left it (a restore keeps no copy). A restore llama-server refused (the file does not fit
   this server: another KV layout, a damaged file) deletes the file; one with no answer after which
   the server does not answer either quarantines it (llama-server may have crashed reading it: it
   is never tried again); any other failure (a slow restore behind long batches) keeps it. A file
   whose bytes are not the ones saved (size or digest, checked before every restore and at start)
   is deleted.
9. Model. Once llama-server's model is known, files saved from another model are deleted.
10. Start. The index's files that are not on disk are forgotten, those whose size on disk is not the
   size saved (cut short by a power loss) are deleted; slotwise's files on disk that the index does
   not list (a save cut short, a probe, a lost index) are deleted; then the budget runs.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import replace

from proxy.estimate.chains import BLOCK_TOKENS, common_blocks
from proxy.keep.budget import over_budget
from proxy.keep.values import (
    Conversation,
    Delete,
    ForgetCache,
    KeepDecision,
    KeepFile,
    KeepKnobs,
    Lora,
    Quarantine,
    RestoreInto,
    SavedFile,
    SaveSlot,
    SlotState,
    WarmPrefix,
    Where,
    file_name,
    keeps_restored_kv,
)

PLACE_WITHIN_S = 5.0
"""How long after its end a conversation is looked for in the slots (rule 2)."""
MOST = 0.5
"""The share of a prompt a file must hold for a restore (rule 7)."""
MAX_CONVERSATIONS = 512
"""Conversations remembered without a file at most; the oldest are forgotten first."""


class KeepStore:
    def __init__(self, knobs: KeepKnobs) -> None:
        self.knobs = knobs
        self.files: dict[str, SavedFile] = {}
        self.conversations: dict[str, Conversation] = {}
        self.model: str | None = None
        self.saving: SaveSlot | None = None
        self.restoring: dict[int, RestoreInto] = {}
        self.displaced_tokens = 0
        """Tokens of unsaved conversations that restores pushed out of their slots (rule 7)."""
        self._tasks: dict[int, int | None] = {}  # each slot's task at the last read (rule 3)
        self._warm_placing: list[WarmPrefix] = []
        self.warm_in: dict[int, WarmPrefix] = {}
        """The warm-up prefix each slot holds (rule 2), by slot id."""

    # ---- rule 1 ----------------------------------------------------------------------------------

    def on_request_ended(self, chain: Sequence[int], variant: str, prompt_tokens: int,
                         generated: int, now: float) -> None:
        if not chain:
            return
        key = tuple(chain)
        name = file_name(key, variant)
        self.conversations.pop(name, None)
        self.conversations[name] = Conversation(
            name=name, chain=key, variant=variant, prompt_tokens=prompt_tokens, ended=now,
            lo=prompt_tokens, hi=prompt_tokens + max(0, generated))
        self._forget_old()

    def on_warm_piece(self, chain: Sequence[int], tokens: int, now: float) -> None:
        """Rule 2: a warm-up's piece ended; its prefix of `tokens` is in a slot now."""
        if chain:
            key = tuple(chain)
            self._warm_placing = [p for p in self._warm_placing if key[:len(p.chain)] != p.chain]
            self._warm_placing.append(WarmPrefix(key, tokens, now))

    # ---- rules 2, 3, 4 ---------------------------------------------------------------------------

    def on_slots(self, slots: Sequence[SlotState], now: float, *, quiet: bool) -> list[KeepDecision]:
        """A fresh read of `/slots`; `quiet`: no request is in flight."""
        decisions: list[KeepDecision] = []
        if self._restarted(slots):
            decisions.append(ForgetCache())
            self.warm_in.clear()
            for conv in list(self.conversations.values()):
                if conv.placing:  # it ended since the last read: it ran on the server as it is now
                    continue
                self._leave(conv)
                if not self.saved(conv):
                    del self.conversations[conv.name]
        self._tasks = {s.id: s.task for s in slots}
        by_id = {s.id: s for s in slots}
        for conv in self.conversations.values():
            if conv.slot is not None and not _unchanged(conv, by_id.get(conv.slot)):
                self._leave(conv)
        self._place(slots, now)
        self._place_warm(slots, now)
        if quiet and self.saving is None:
            save = self._next_save(by_id, now)
            if save is not None:
                self.saving = save
                decisions.append(save)
        return decisions

    def _restarted(self, slots: Sequence[SlotState]) -> bool:
        for slot in slots:
            before = self._tasks.get(slot.id)
            if before is not None and (slot.task is None or slot.task < before):
                return True
        return False

    def _place(self, slots: Sequence[SlotState], now: float) -> None:
        placing = sorted((c for c in self.conversations.values() if c.placing),
                         key=lambda c: c.ended, reverse=True)
        taken = {c.slot for c in self.conversations.values() if c.slot is not None and not c.placing}
        for conv in placing:
            fits = [s for s in slots if not s.busy and conv.lo <= s.tokens <= conv.hi
                    and s.id not in taken and s.id not in self.restoring]
            if fits:
                slot = max(fits, key=lambda s: -1 if s.task is None else s.task)
                conv.slot, conv.task, conv.slot_tokens, conv.placing = slot.id, slot.task, slot.tokens, False
                taken.add(slot.id)
            elif now - conv.ended > PLACE_WITHIN_S:
                conv.placing = False

    def _place_warm(self, slots: Sequence[SlotState], now: float) -> None:
        by_id = {s.id: s for s in slots}
        for slot_id, prefix in list(self.warm_in.items()):
            s = by_id.get(slot_id)
            if s is None or s.busy or s.task != prefix.task or s.tokens != prefix.tokens:
                del self.warm_in[slot_id]
        known = {c.slot for c in self.conversations.values() if c.slot is not None}
        fresh = [p for p in self._warm_placing if now - p.ended <= PLACE_WITHIN_S]
        unplaced: list[WarmPrefix] = []
        for prefix in reversed(fresh):  # the newest first
            fits = [s for s in slots if not s.busy and s.tokens == prefix.tokens
                    and s.id not in known and s.id not in self.warm_in]
            if fits:
                slot = max(fits, key=lambda s: -1 if s.task is None else s.task)
                self.warm_in[slot.id] = replace(prefix, task=slot.task)
            else:
                unplaced.append(prefix)
        self._warm_placing = unplaced[::-1]

    def _next_save(self, slots: dict[int, SlotState], now: float) -> SaveSlot | None:
        due: list[tuple[float, int, Conversation]] = []
        for c in self.conversations.values():
            if (c.slot is not None and now - c.ended >= self.knobs.save_after_idle_s
                    and _unchanged(c, slots.get(c.slot)) and c.slot not in self.restoring
                    and not c.given_up and self.worth_saving(c)):
                due.append((c.ended, c.slot, c))
        if not due:
            return None
        _, slot, conv = min(due, key=lambda d: d[0])
        return SaveSlot(slot=slot, name=conv.name, tokens=conv.slot_tokens)

    # ---- rules 5, 6 ------------------------------------------------------------------------------

    def on_saved(self, save: SaveSlot, n_saved: int, size: int, now: float, *,
                 digest: str) -> list[KeepDecision]:
        self.saving = None
        conv = self.conversations.get(save.name)
        if conv is None or n_saved != save.tokens:
            return [Delete(save.temp, f"the slot held {n_saved} tokens, not the {save.tokens} "
                                      "of its conversation: it changed during the save")]
        new = SavedFile(name=save.name, chain=conv.chain, variant=conv.variant,
                        model=self.model or "", tokens=n_saved, size=size, saved_at=now,
                        last_used=now, digest=digest)
        old = self.files.get(save.name)
        if old is not None:
            new.uses = old.uses
        superseded: list[KeepDecision] = [
            Delete(f.name, f"superseded by {save.name}, a longer prefix of its conversation")
            for f in self.files.values()
            if f.name != save.name and f.variant == new.variant and len(f.chain) <= len(new.chain)
            and common_blocks(f.chain, new.chain) == len(f.chain)]
        self.forget(d.name for d in superseded if isinstance(d, Delete))
        self.files[save.name] = new
        budget = self.budget(now)
        conv.given_up = save.name not in self.files
        return [KeepFile(save.temp, save.name), *superseded, *budget]

    def on_save_dropped(self, save: SaveSlot) -> None:
        """It did not go (the server was busy again): due at the next quiet look."""
        if self.saving == save:
            self.saving = None

    def on_save_failed(self, save: SaveSlot) -> None:
        self.saving = None
        if (conv := self.conversations.get(save.name)) is not None:
            conv.given_up = True

    def budget(self, now: float) -> list[KeepDecision]:
        protected = {r.name for r in self.restoring.values()}
        deletes = over_budget(self.files.values(), self.knobs, now, protected)
        self.forget(d.name for d in deletes)
        return list(deletes)

    def forget(self, names: Iterable[str]) -> None:
        """The files `names` are deleted (or gone): forget them."""
        for name in names:
            self.files.pop(name, None)

    # ---- rules 7, 8 ------------------------------------------------------------------------------

    def candidate(self, chain: Sequence[int], variant: str, prompt_tokens: int,
                  cached: int) -> tuple[SavedFile, int] | None:
        """The file worth restoring for this prompt and how many of its tokens it covers, if any."""
        key, best = tuple(chain), None
        for f in self.files.values():
            if f.variant != variant or self.model is None or f.model != self.model:
                continue
            covered = min(common_blocks(f.chain, key) * BLOCK_TOKENS, f.tokens, prompt_tokens - 1)
            if best is None or covered > best[1]:
                best = (f, covered)
        if best is None or not worth_restoring(best[1], cached, prompt_tokens, self.knobs.min_tokens):
            return None
        return best

    def saving_spares(self, chain: Sequence[int], variant: str, prompt_tokens: int) -> int:
        """Rule 7: how many more of this prompt's tokens the conversation being saved now holds
        than the best file does (0 when no save runs or it is another conversation's). Its request
        restores the new file once the save ends, rather than an older one now (bench day: `dan`
        came back while his 6,877 tokens were being saved to make room for `eve`, restored
        yesterday's 6,047 instead and computed 889 tokens, 6.9 s to his first token)."""
        save = self.saving
        conv = None if save is None else self.conversations.get(save.name)
        if save is None or conv is None or conv.variant != variant:
            return 0
        holds = min(common_blocks(conv.chain, tuple(chain)) * BLOCK_TOKENS, save.tokens,
                    prompt_tokens - 1)
        found = self.candidate(chain, variant, prompt_tokens, 0)
        return max(0, holds - (found[1] if found is not None else 0))

    def restore(self, chain: Sequence[int], variant: str, prompt_tokens: int, cached: int,
                slots: Sequence[SlotState], lora: Lora | None = None,
                others: Iterable[tuple[Sequence[int], int]] = ()) -> RestoreInto | None:
        """`lora`: the request's explicit LoRA settings (None: it sends none). `others`: the
        chain and prompt length of every other request in flight (`wanted`)."""
        found = self.candidate(chain, variant, prompt_tokens, cached)
        if found is None:
            return None
        using = set(self.restoring) | ({self.saving.slot} if self.saving else set())
        free = [s for s in slots if not s.busy and s.id not in using]
        wanted = self.wanted(others, [s.id for s in free])
        idle = [s for s in free if s.id not in wanted]
        if not idle:
            return None
        placed = {c.slot: c for c in self.conversations.values() if c.slot is not None}
        saved = {slot for slot, c in placed.items() if self.saved(c)}
        slot = min(idle, key=lambda s: (s.tokens > 0, s.id not in saved, s.id not in placed,
                                        s.tokens, not keeps_restored_kv(s, lora),
                                        -1 if s.task is None else s.task))
        decision = RestoreInto(slot=slot.id, name=found[0].name, covered=found[1],
                               displaced=slot.tokens if slot.id not in saved else 0,
                               prime=not keeps_restored_kv(slot, lora))
        self.restoring[slot.id] = decision
        return decision

    def wanted(self, requests: Iterable[tuple[Sequence[int], int]], idle: Sequence[int]) -> set[int]:
        """Rule 7: of the `idle` slots, those llama-server would give one of `requests` (chain,
        prompt tokens) by its prompt similarity: the slot whose conversation (or warm-up prefix)
        shares the longest prefix with it, if that is at least SLOT_SIMILARITY of its prompt
        (llama-server's `--slot-prompt-similarity`, 0.1 by default)."""
        held = [(slot, conv.chain) for slot in idle if (conv := self.in_slot(slot)) is not None]
        held += [(slot, self.warm_in[slot].chain) for slot in idle
                 if slot in self.warm_in and self.in_slot(slot) is None]
        wanted = set()
        for chain, tokens in requests:
            best = max(((common_blocks(c, chain), slot) for slot, c in held), default=(0, -1))
            if best[0] and best[0] * BLOCK_TOKENS >= SLOT_SIMILARITY * tokens:
                wanted.add(best[1])
        return wanted

    def displaced_save(self, restore: RestoreInto) -> SaveSlot | None:
        """Rule 7: the unsaved conversation `restore` would push out of its slot, to save first
        (None: nothing worth it, or another save runs)."""
        conv = self.in_slot(restore.slot)
        if (conv is None or not self.worth_saving(conv) or conv.given_up
                or self.saving is not None or conv.slot_tokens < self.knobs.min_tokens):
            return None
        self.saving = SaveSlot(slot=restore.slot, name=conv.name, tokens=conv.slot_tokens)
        return self.saving

    def room_made(self, restore: RestoreInto) -> RestoreInto:
        """Rule 7: `restore` once the conversation in its slot was saved first (`displaced_save`):
        it displaces nothing when a file holds that conversation now."""
        conv = self.in_slot(restore.slot)
        if conv is None or not self.saved(conv) or restore.displaced == 0:
            return restore
        made = replace(restore, displaced=0)
        if self._is_running(restore):
            self.restoring[restore.slot] = made
        return made

    def in_slot(self, slot: int) -> Conversation | None:
        """The conversation known to be in `slot` now."""
        return next((c for c in self.conversations.values() if c.slot == slot), None)

    def on_restored(self, restore: RestoreInto, n_restored: int, task: int | None,
                    now: float) -> None:
        self.release(restore)
        self.displaced_tokens += restore.displaced
        f = self.files.get(restore.name)
        if f is None:
            return
        f.last_used, f.uses = now, f.uses + 1
        for conv in self.conversations.values():
            if conv.slot == restore.slot:
                self._leave(conv)
        conv = self.conversations.get(f.name) or Conversation(
            name=f.name, chain=f.chain, variant=f.variant, prompt_tokens=f.prompt_tokens,
            ended=now, lo=n_restored, hi=n_restored)
        conv.slot, conv.task, conv.slot_tokens, conv.placing = restore.slot, task, n_restored, False
        self.conversations[f.name] = conv

    def on_restore_failed(self, restore: RestoreInto, *, status: int | None,
                          server_gone: bool = False) -> list[KeepDecision]:
        """`status`: llama-server's answer, None when none came; `server_gone`: none came and the
        server does not answer since (it may have crashed on the file)."""
        self.on_restore_abandoned(restore)
        if server_gone:
            self.forget([restore.name])
            return [Quarantine(restore.name, "its restore got no answer: llama-server may have "
                                             "crashed reading it, so it is never restored again")]
        if status == 400:
            self.forget([restore.name])
            return [Delete(restore.name, "llama-server refused to restore it (another KV layout "
                                         "or model, or a damaged file)")]
        return []

    def on_restore_abandoned(self, restore: RestoreInto) -> None:
        """A restore that ended without its answer (failed, or its caller left): the slot is free
        again, and what it holds is not known (a failed restore empties it)."""
        self.release(restore)
        for conv in self.conversations.values():
            if conv.slot == restore.slot:
                self._leave(conv)

    def release(self, restore: RestoreInto) -> None:
        """A restore that will not be asked for (or whose caller left): its slot is free again."""
        if self._is_running(restore):
            del self.restoring[restore.slot]

    def _is_running(self, restore: RestoreInto) -> bool:
        """Whether `restore` holds its slot: a slot has one restore, of one file (not compared
        whole: a slot left claimed by a restore that ended is passed by for good)."""
        running = self.restoring.get(restore.slot)
        return running is not None and running.name == restore.name

    def on_damaged(self, name: str, why: str) -> list[KeepDecision]:
        """The file's bytes are not the ones saved (`why`): it goes, and no restore of it runs."""
        for restore in [r for r in self.restoring.values() if r.name == name]:
            self.release(restore)
        self.forget([name])
        return [Delete(name, f"damaged: {why}")]

    # ---- rule 9 ----------------------------------------------------------------------------------

    def set_model(self, model: str) -> list[KeepDecision]:
        self.model = model
        deletes = [Delete(f.name, f"saved from another model ({f.model or 'unknown'})")
                   for f in self.files.values() if f.model != model]
        self.forget(d.name for d in deletes)
        return list(deletes)

    # ---- rule 10 ---------------------------------------------------------------------------------

    def load(self, files: Iterable[SavedFile], on_disk: dict[str, int], now: float) -> list[KeepDecision]:
        """The index read at start, and slotwise's files found on disk (name -> size)."""
        listed = {f.name: f for f in files if f.name in on_disk}
        self.files = {name: f for name, f in listed.items() if on_disk[name] == f.size}
        cut: list[KeepDecision] = [Delete(name, f"damaged: {on_disk[name]} bytes on disk, {f.size} "
                                            "saved (cut short, as by a power loss)")
                               for name, f in sorted(listed.items()) if name not in self.files]
        orphans: list[KeepDecision] = [Delete(name, "not in slotwise's index (a save cut short, or a "
                                                "lost index)")
                                   for name in sorted(on_disk) if name not in listed]
        return [*cut, *orphans, *self.budget(now)]

    # ---- views -----------------------------------------------------------------------------------

    def where(self, conv: Conversation) -> Where:
        if conv.slot is not None:
            return Where.SLOT
        return Where.FILE if self.saved(conv) else Where.RAM

    def disk_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    # ---- helpers ---------------------------------------------------------------------------------

    def saved(self, conv: Conversation) -> bool:
        """A file of its variant holds its whole prompt (or more of the same conversation)."""
        return any(f.variant == conv.variant and len(f.chain) >= len(conv.chain)
                   and common_blocks(f.chain, conv.chain) == len(conv.chain)
                   for f in self.files.values())

    def worth_saving(self, conv: Conversation) -> bool:
        """Rule 1: its prompt has `min_tokens` or more, and no file holds it yet."""
        return conv.prompt_tokens >= self.knobs.min_tokens and not self.saved(conv)

    def _leave(self, conv: Conversation) -> None:
        conv.slot, conv.task, conv.slot_tokens = None, None, 0

    def _forget_old(self) -> None:
        extra = len(self.conversations) - MAX_CONVERSATIONS
        if extra <= 0:
            return
        for conv in sorted(self.conversations.values(), key=lambda c: c.ended)[:extra]:
            del self.conversations[conv.name]


SLOT_SIMILARITY = 0.1
"""llama-server's `--slot-prompt-similarity` default: a request goes to the idle slot whose cached
prompt covers the largest share of its own, if at least this share."""


def worth_restoring(covered: int, cached: int, prompt_tokens: int, min_tokens: int) -> bool:
    """Rule 7's bar: a file covering `covered` of the prompt's tokens is restored only if that
    is `MOST` of the prompt and spares `min_tokens` more than the server holds (`cached`)."""
    return covered >= MOST * prompt_tokens and covered - cached >= min_tokens


def _unchanged(conv: Conversation, slot: SlotState | None) -> bool:
    return (slot is not None and not slot.busy and slot.task == conv.task
            and slot.tokens == conv.slot_tokens)


def names(decisions: Collection[KeepDecision]) -> list[str]:
    """The files a list of decisions deletes (tests, logs)."""
    return [d.name for d in decisions if isinstance(d, Delete)]
