"""The keeper: the one place where the keep store's decisions become I/O.

It probes at start whether saving works; driven by the prefill gate's one loop (its `KeepHook`), it
reads `/slots` after requests end and while saves may come due, asks llama-server to save an idle
slot (`POST /slots/N?action=save`, one at a time, when the policy finds the server quiet) and to
restore a file into an idle slot before a returning conversation's request is forwarded (when the
policy says so), keeps the files private, synced, renamed, deleted and listed in the index, and
writes one timing record per save and per restore. A file is hashed when saved and checked before
every restore (and once at start, in a thread): llama-server aborts on a damaged one. Restores fail
open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.config import KeepKvConfig
from proxy.estimate import Estimate, block_hashes, common_prefix, estimate
from proxy.keep.files import KeptFiles
from proxy.keep.probe import UNKNOWN, Probe, probe
from proxy.keep.record import kv_flight, kv_record
from proxy.keep.store import KeepStore
from proxy.keep.values import (
    Delete,
    ForgetCache,
    KeepDecision,
    KeepFile,
    RestoreInto,
    SaveSlot,
    SlotState,
    client_digest,
    knobs,
    lora_settings,
    lora_variant,
    read_slots,
)
from proxy.prefill.estimator import Estimator
from proxy.prefill.events import Restorable
from proxy.prefill.hooks import Restored
from proxy.record.flight import Flight, Phase
from proxy.record.kind import Kind
from proxy.record.outcome import Outcome
from proxy.state import ProxyState
from proxy.upstream import UpstreamCallError

log = logging.getLogger("slotwise.keep")

SLOTS_TIMEOUT_S = 2.0
SAVE_TIMEOUT_S = 300.0
SAVE_WAIT_S = 10.0
"""At most this long a restore waits for the save of its own conversation to end (a save of 7,000
tokens took 0.6-1.0 s on the testbed), rather than restore an older file (store rule 7), however few
blocks more the save holds: the older file leaves its request every token it lacks to compute, in
pieces beside the streams (bench day: 640 tokens by the blocks' count, under `min_tokens`, and
`dan`, who waited for nothing, computed 889, 7.9 s to his first token; the save had 0.3 s left)."""
RESTORE_TIMEOUT_S = 30.0
"""A restore waits in llama-server's queue behind the batch running (seconds for a long prompt)."""
HEALTH_TIMEOUT_S = 3.0
READ_BYTES_PER_S = 100e6
"""A restore's timeout grows by the time a slow disk takes to read its file; until restores were
measured, a restore is taken to cost that time."""
RESTORE_COST_WEIGHT = 0.3
"""How much each measured restore moves the learned cost per byte."""
PLACE_POLL_S = 0.5
"""How soon `/slots` is read after a request ended (to find the slot it left its KV in)."""
MAX_POLL_S = 30.0
PROBE_RETRY_S = 15.0


NOT_IN_A_SLOT_YET = frozenset({Phase.ARRIVED, Phase.HELD, Phase.QUEUED})
"""Requests whose slot llama-server has not given yet (it gives an idle one by similarity)."""


class Keeper:
    def __init__(self, state: ProxyState, estimator: Estimator, *,
                 wake: asyncio.Event | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self._state = state
        self._estimator = estimator
        self._wall = wall
        cfg = state.config.keep_kv
        self.store = KeepStore(knobs(cfg))
        self.files = KeptFiles(Path(cfg.dir), self.store)
        self.probe: Probe = UNKNOWN
        self._flights: dict[Flight, tuple[tuple[int, ...], str, int]] = {}  # until they end
        self._wake = wake if wake is not None else asyncio.Event()
        """The scheduler's wake-up (set when a look is wanted at once)."""
        self._ready = False
        """Probed working and the files checked: looks and saves may begin."""
        self._look_now = True
        self._looked_at = 0.0
        self.saves = Counter[str]()
        self.restores = Counter[str]()
        """Saves and restores by outcome (the metrics)."""
        self.restored_tokens = 0
        self._no_save = asyncio.Event()
        self._no_save.set()
        """Clear while a save runs."""
        self.restore_ms_per_byte = 1000.0 / READ_BYTES_PER_S
        """What a restore costs llama-server's main loop, learned from each (a moving average)."""

    def now(self) -> float:
        """The wall clock the store's times are on."""
        return self._wall()

    @property
    def working(self) -> bool:
        return self.probe.working is True

    def reconfigure(self, config: KeepKvConfig) -> None:
        self.store.knobs = knobs(config)
        self._wants_a_look()

    def _wants_a_look(self) -> None:
        self._look_now = True
        self._wake.set()

    # ---- start -------------------------------------------------------------------------------------

    def load(self) -> None:
        """The index and the files on disk (rule 10 of the store)."""
        self.files.load(self._wall())

    async def start(self) -> None:
        """Probe until llama-server answers; say once whether saving works."""
        while self.probe.working is None:
            self.probe = await probe(self._state.upstream, self.files.dir)
            if self.probe.working is None:
                log.debug("keep_kv: %s", self.probe.note)
                await asyncio.sleep(PROBE_RETRY_S)
        if not self.working:
            log.warning("keep_kv: %s", self.probe.note)
            return
        kept = f"{len(self.store.files)} saved conversations ({self.store.disk_bytes() / 1e9:.2f} GB)"
        if self.probe.private:
            log.info("keep_kv: %s; %s", self.probe.note, kept)
        else:  # the note says what is wrong with the directory: once, as a warning
            log.info("keep_kv: %s", kept)
            self.files.shelf.report(self.probe.note)
        if self.probe.model is not None:  # a working probe always read it
            self._apply_now(self.store.set_model(self.probe.model))

    # ---- the scheduler's hooks --------------------------------------------------------------------

    async def restorable(self, flight: Flight, ids: list[int],
                         est: Estimate) -> tuple[Estimate, Restorable | None]:
        """What a kept file could spare this request (None: nothing worth a restore), with the
        estimate corrected by a fresh look at the slots (a restart of llama-server empties them)."""
        if not self.working or not ids:
            return est, None
        chain, variant = tuple(block_hashes(ids)), self._variant(flight)
        if flight.kind is not Kind.OTHER:  # a warm-up never ends as a request: nothing to place
            self._flights[flight] = (chain, variant, len(ids))
        # Asked as if nothing were cached: after a restart of llama-server the cache model is stale
        # until `/slots` shows it, and that read (a few ms, answered mid-decode) comes next.
        if self.store.candidate(chain, variant, len(ids), 0) is None:
            return est, None
        try:
            self._apply_now(self.store.on_slots(await self._slots(), self._wall(), quiet=False))
        except (UpstreamCallError, ValueError) as exc:
            log.debug("keep_kv: cannot read /slots: %s", exc)
            return est, None
        est = estimate(ids, self._estimator.cache)  # a restart just seen empties the cache model
        found = self.store.candidate(chain, variant, len(ids), est.cached_tokens)
        if found is None:
            return est, None
        saved, covered = found
        restore_ms = self.restore_ms_per_byte * saved.size
        return est, Restorable(tokens=covered - est.cached_tokens, restore_ms=restore_ms,
                               max_wait_s=self.store.knobs.max_wait_s)

    def warmed(self, ids: Sequence[int]) -> None:
        if self.working and ids:
            self.store.on_warm_piece(tuple(block_hashes(ids)), len(ids), self._wall())
            self._wants_a_look()  # placed while its slot still shows it

    async def restore(self, flight: Flight, ids: list[int]) -> Restored:
        """Restore this request's file into an idle slot now (the scheduler counted one free)."""
        try:
            return await self._restore(flight, ids)
        except Exception as exc:  # a bug here must not fail the request
            log.exception("keep_kv: restoring for %s failed inside slotwise", flight.id)
            return Restored(estimate(ids, self._estimator.cache),
                            f"internal error ({type(exc).__name__})", done=False)

    async def _restore(self, flight: Flight, ids: list[int]) -> Restored:
        chain, variant, _ = self._flights.get(flight) or (tuple(block_hashes(ids)),
                                                           self._variant(flight), len(ids))
        if self.store.saving_spares(chain, variant, len(ids)) > 0:
            with contextlib.suppress(TimeoutError):  # then the file there is
                await asyncio.wait_for(self._no_save.wait(), SAVE_WAIT_S)
        try:
            slots = await self._slots()
        except (UpstreamCallError, ValueError) as exc:
            return Restored(estimate(ids, self._estimator.cache), f"cannot read /slots: {exc}",
                            done=False)
        self._apply_now(self.store.on_slots(slots, self._wall(), quiet=False))
        est = estimate(ids, self._estimator.cache)
        lora = None if flight.lora_out is None else lora_settings(flight.lora_out)
        others = [(c, n) for f, (c, _, n) in self._flights.items()
                  if f is not flight and f.phase in NOT_IN_A_SLOT_YET]
        restore = self.store.restore(chain, variant, len(ids), est.cached_tokens, slots, lora,
                                     others)
        if restore is None:
            found = self.store.candidate(chain, variant, len(ids), est.cached_tokens)
            if found is None:  # the server's cache holds it now, or the file went
                return Restored(est, None, done=True)
            # said at info: the policy counted a slot free for this restore, so the two disagree
            # (bench day: a slot a finished restore left claimed, and a returning user waited 60 s)
            log.info("keep_kv: no idle slot to restore %s into for %s: /slots shows %s busy; "
                     "slotwise is restoring into %s, saving %s", found[0].name, flight.id,
                     sorted(s.id for s in slots if s.busy) or "none",
                     sorted(self.store.restoring) or "none",
                     self.store.saving.slot if self.store.saving else "none")
            return Restored(est, f"no idle slot to restore {found[0].name} into", done=False,
                            no_slot=True)
        try:
            if (damage := await self.files.check(restore)) is not None:
                return Restored(est, f"{restore.name} is damaged ({damage}): deleted", done=False)
            covered = await self._covered(restore, ids)
            restore = await self._make_room(restore)
            if restore.prime and (why := await self._prime(restore.slot, ids, flight.lora_out)):
                self.store.on_restore_abandoned(restore)
                return Restored(est, f"could not prepare slot {restore.slot}: {why}", done=False)
        except BaseException:  # its caller left (a warm-up ended, a client gone), or a bug
            # The slot must not stay claimed by a restore that will never run: every later
            # restore would pass it by while the policy counts it free.
            self.store.on_restore_abandoned(restore)
            raise
        task = next((s.task for s in slots if s.id == restore.slot), None)
        why = await self._restore_call(flight, restore, task, covered)
        if why is not None:
            return Restored(est, f"restoring {restore.name} failed: {why}", done=False)
        self._estimator.learn(ids[:covered], None)
        flight.restored_tokens = covered
        self.restored_tokens += covered
        return Restored(estimate(ids, self._estimator.cache), None, done=True)

    async def _covered(self, restore: RestoreInto, ids: list[int]) -> int:
        """The prompt tokens the restored slot will hold, to the token: the file's own token ids
        against the prompt's (its reply too, where the prompt repeats it as generated). The
        index's chain counts whole 64-token blocks of the prompt only: `bench day`'s `dan-0` was
        estimated at 82 new tokens after his restore and computed 58, too many to be trimmed.
        llama-server computes at least one token of a prompt."""
        held = await self.files.tokens(restore.name)
        if held is None:
            return restore.covered
        return min(common_prefix(held, ids), len(ids) - 1)

    async def _prime(self, slot: int, ids: list[int], lora: Any) -> str | None:
        """A one-token task with the request's LoRA settings, pinned to the idle slot the restore
        goes into: llama-server then keeps the restored KV for the request (it clears a slot's
        cache when a request's explicit `lora` differs from the slot's last one). Why it failed."""
        body = {"prompt": ids[:1], "n_predict": 0, "id_slot": slot, "lora": lora,
                "cache_prompt": True}
        try:
            await self._state.upstream.post_json("/completion", body, timeout_s=SLOTS_TIMEOUT_S * 5)
        except UpstreamCallError as exc:
            return str(exc)
        return None

    async def _make_room(self, restore: RestoreInto) -> RestoreInto:
        """The conversation in the slot leaves the server's cache model; saved first when no file
        holds it (the store's rule 7): then the restore displaces nothing."""
        leaving = self.store.in_slot(restore.slot)
        if leaving is None:
            return restore
        self._estimator.cache.forget(leaving.chain)
        if (save := self.store.displaced_save(restore)) is not None:
            await self.save(save)
            return self.store.room_made(restore)
        return restore

    async def _restore_call(self, flight: Flight, restore: RestoreInto, task: int | None,
                            covered: int) -> str | None:
        """The restore and its record; why it failed, or None."""
        saved = self.store.files.get(restore.name)
        size = saved.size if saved is not None else 0
        rec = self._flight(f"{flight.id}-restore", restore.slot, Kind.KV_RESTORE, restore.name,
                           flight.client)
        started = self._state.clock()
        rec.kv_tokens, rec.kv_bytes = (saved.tokens if saved else None), size
        try:
            answer = await self._state.upstream.post_json(
                f"/slots/{restore.slot}?action=restore", {"filename": restore.name},
                timeout_s=RESTORE_TIMEOUT_S + size / READ_BYTES_PER_S)
            n_restored = _count(answer, "n_restored")
        except UpstreamCallError as exc:
            gone = exc.status is None and not await self._answers_health()
            self._apply_now(self.store.on_restore_failed(restore, status=exc.status,
                                                         server_gone=gone))
            self._record(rec, Outcome.FAILED, str(exc), exc.status)
            return str(exc)
        except BaseException as exc:  # the client left, or a bug: the slot is free again
            self.store.on_restore_abandoned(restore)
            gone = isinstance(exc, asyncio.CancelledError)
            self._record(rec, Outcome.CLIENT_GONE if gone else Outcome.FAILED,
                         "the request's client left" if gone else f"internal error: {exc!r}", None)
            raise
        self.store.on_restored(restore, n_restored, task, self._wall())
        if size > 0:  # what a restore costs the server's main loop, per byte of file
            took_ms = (self._state.clock() - started) * 1000.0
            self.restore_ms_per_byte += RESTORE_COST_WEIGHT * (took_ms / size
                                                               - self.restore_ms_per_byte)
        rec.kv_tokens, rec.restored_tokens = n_restored, covered
        rec.kv_bytes = answer["n_read"] if isinstance(answer.get("n_read"), int) else size
        displaced = (f"displaced {restore.displaced} tokens of an unsaved conversation from slot "
                     f"{restore.slot}") if restore.displaced else None
        self._record(rec, Outcome.DONE, None, 200, displaced)
        self.files.write_index()
        return None

    # ---- requests that end ------------------------------------------------------------------------

    def on_phase(self, flight: Flight, old: Phase, new: Phase, now: float) -> None:
        """Registry listener: a request that ended well left its conversation in a slot."""
        if new is not Phase.DONE:
            return
        self._wants_a_look()  # where it left its KV; also a save that waited for quiet may go now
        entry = self._flights.pop(flight, None)
        if entry is None or flight.outcome != "done" or flight.status != 200:
            return
        chain, variant, n_ids = entry
        predicted = (flight.timings or {}).get("predicted_n")
        generated = predicted if isinstance(predicted, int) else flight.decoded
        self.store.on_request_ended(chain, variant, flight.prompt_tokens or n_ids, generated,
                                    self._wall())

    # ---- start, and the looks the scheduler runs ----------------------------------------------------

    async def open(self) -> None:
        """Probe, then check every kept file; the scheduler's looks begin after."""
        try:
            await self.start()
        except Exception as exc:  # keep_kv stays off; requests go as usual
            log.exception("keep_kv: the probe failed inside slotwise")
            self.probe = Probe(False, f"the probe failed inside slotwise: {exc!r}; keep_kv stays off")
        if not self.working:
            return
        try:
            await self.files.check_all()
        except Exception:  # every restore checks its file anyway
            log.exception("keep_kv: checking the kept files failed inside slotwise")
        self._ready = True
        self._wants_a_look()

    def next_look_in(self, quiet: bool) -> float | None:
        """Seconds until the next look at `/slots` (None before the probe found saving works)."""
        if not self._ready:
            return None
        if self._look_now:
            return 0.0
        return max(0.0, self._looked_at + self._poll_s(quiet) - self._wall())

    async def look(self, quiet: bool) -> SaveSlot | None:
        """One read of `/slots`: place, run the budget; the save due if `quiet`. Never raises."""
        self._look_now, self._looked_at = False, self._wall()
        try:
            slots = await self._slots()
        except (UpstreamCallError, ValueError) as exc:
            log.debug("keep_kv: cannot read /slots: %s", exc)
            return None
        try:
            now = self._wall()
            decisions = self.store.on_slots(slots, now, quiet=quiet)
            self._apply_now([*decisions, *self.store.budget(now)])
        except Exception:  # a bug must not stop the looks: the next one tries again
            log.exception("keep_kv: a look at the slots failed inside slotwise")
            return None
        return next((d for d in decisions if isinstance(d, SaveSlot)), None)

    def save_dropped(self, save: SaveSlot) -> None:
        self.store.on_save_dropped(save)

    def _poll_s(self, quiet: bool) -> float:
        convs = self.store.conversations.values()
        if any(c.placing for c in convs):
            return PLACE_POLL_S
        if not quiet:  # saves wait for quiet: the last request's end asks for a look
            return MAX_POLL_S
        due = [c.ended + self.store.knobs.save_after_idle_s for c in convs
               if c.slot is not None and self.store.worth_saving(c)]
        wait = min(due, default=self._wall() + MAX_POLL_S) - self._wall()
        return min(max(wait, PLACE_POLL_S), MAX_POLL_S)

    async def save(self, save: SaveSlot) -> None:
        """Run a save the policy let go (rule 16): llama-server writes it, slotwise seals and keeps
        it, and writes its record."""
        self._no_save.clear()
        try:
            await self._save(save)
        finally:
            self._no_save.set()

    async def _save(self, save: SaveSlot) -> None:
        rec = self._flight("kv-save", save.slot, Kind.KV_SAVE, save.name, None)
        try:
            answer = await self._state.upstream.post_json(
                f"/slots/{save.slot}?action=save", {"filename": save.temp}, timeout_s=SAVE_TIMEOUT_S)
            n_saved = _count(answer, "n_saved")
        except BaseException as exc:  # no answer, slotwise stopping, or a bug: no save runs
            self.store.on_save_failed(save)
            self._apply_now([Delete(save.temp, "the save failed")])
            if not isinstance(exc, UpstreamCallError):
                raise
            self._record(rec, Outcome.FAILED, str(exc), exc.status)
            return
        try:
            size, digest = await self.files.seal(save.temp, save.name)
        except OSError as exc:
            self.store.on_save_failed(save)
            self._apply_now([Delete(save.temp, "the save cannot be checked")])
            problem = ("not in keep_kv.dir" if isinstance(exc, FileNotFoundError)
                       else f"cannot be read by slotwise: {exc.strerror}")
            self._record(rec, Outcome.FAILED, f"llama-server saved {save.temp}, but it is "
                                              f"{problem} ({self.files.dir})", 200)
            return
        decisions = self.store.on_saved(save, n_saved, size, self._wall(), digest=digest)
        rec.kv_tokens, rec.kv_bytes = n_saved, size
        kept = any(isinstance(d, KeepFile) for d in decisions)
        self._apply_now(decisions)
        why = next((d.reason for d in decisions if isinstance(d, Delete)
                    and d.name in (save.name, save.temp)), None)
        self._record(rec, Outcome.DONE if kept else Outcome.CHANGED, None if kept else why, 200,
                     f"deleted at once: {why}" if kept and why else None)

    # ---- applying decisions -----------------------------------------------------------------------

    def _apply_now(self, decisions: Sequence[KeepDecision]) -> None:
        """The decisions that need no call to llama-server (saves are awaited by `look`)."""
        if any(isinstance(d, ForgetCache) for d in decisions):
            log.info("keep_kv: llama-server restarted: its cache is empty; %d saved conversations "
                     "remain on disk", len(self.store.files))
            self._estimator.cache.clear()
        self.files.apply(decisions)

    def _variant(self, flight: Flight) -> str:
        """What a conversation's KV is kept under besides its prefix: its LoRA settings, and with
        client keys (`access.cache_scope` client) its client, so that nobody is restored another
        client's conversation (nor learns, by a restore's speed, that it is on disk)."""
        variant = lora_variant(flight.lora_out)
        if self._state.config.access.isolates_caches:
            variant += "@" + client_digest(flight.client)
        return variant

    # ---- I/O helpers ------------------------------------------------------------------------------

    async def _answers_health(self) -> bool:
        """Whether llama-server is up and serving (after a restore got no answer: a slow restore
        behind long batches is not a crash)."""
        try:
            await self._state.upstream.get_json("/health", timeout_s=HEALTH_TIMEOUT_S)
        except UpstreamCallError:
            return False
        return True

    async def _slots(self) -> list[SlotState]:
        return read_slots(await self._state.upstream.get_json("/slots", timeout_s=SLOTS_TIMEOUT_S))

    def _flight(self, call_id: str, slot: int, kind: Kind, name: str, client: str | None) -> Flight:
        """A save's or restore's record facts, under an id from the one issuer of ids (unique
        among every request's: a client's X-Request-Id cannot take it, nor it a client's)."""
        state = self._state
        rid = state.ids.issue(call_id, lambda taken: state.registry.get(taken) is not None)
        return kv_flight(rid, slot, kind, name, now=state.clock(), wall=time.time(),
                         config_gen=state.config_gen, client=client)

    def _record(self, flight: Flight, outcome: Outcome, error: str | None,
                status: int | None, note: str | None = None) -> None:
        flight.outcome, flight.error, flight.status = outcome, error, status
        flight.prefill.note = note
        record = kv_record(flight, self._state.clock())
        (self.saves if flight.kind is Kind.KV_SAVE else self.restores)[outcome] += 1
        self._state.emit(record)


KEEPER = web.AppKey("slotwise_keeper", Keeper)
"""The running keeper (only when keep_kv.enabled): built with the scheduler (proxy/scheduler.py)."""


def _count(answer: Any, key: str) -> int:
    """A count from a save's or restore's answer; UpstreamCallError when it has none."""
    value = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(value, int):
        raise UpstreamCallError(f"the slot action's answer has no integer {key}", status=200)
    return value
