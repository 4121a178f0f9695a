"""The warmer: the one place where the warm-up queue's decisions become I/O.

It renders a warm-up's stable prefix (`stable_prefix`), feeds its pieces with the scheduler's
`PieceFeeder` (token-id prefixes to `/completion`, `n_predict: 0`, never pinned), corrects the cache
model after each, restores a kept file that holds a warm-up's prefix (keep_kv, through the
keeper) before its pieces, ends a warm-up when a real request of its conversation arrives (`claim`,
the prefill gate's hook) and writes one timing record per warm-up. The gate's one loop ticks the
queue (`tick`) under the load the prefill policy gives.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections import Counter
from collections.abc import Mapping
from typing import Any

from proxy.config import PrefillConfig
from proxy.estimate import Estimate, EstimateError
from proxy.prefill.estimator import Estimator
from proxy.prefill.events import Load, Sizer
from proxy.prefill.feeder import PieceError, PieceFeeder
from proxy.prefill.hooks import KeepHook
from proxy.record.flight import Flight
from proxy.state import ProxyState
from proxy.warm.prefix import chat_renders, common_prefix, is_chat_like
from proxy.warm.queue import WarmQueue
from proxy.warm.record import ended_warm_record
from proxy.warm.values import (
    CancelWarmPiece,
    Ended,
    Feed,
    RestoreKept,
    WarmDecision,
    WarmKnobs,
    WarmUp,
    warm_knobs,
)

log = logging.getLogger("slotwise.warm")

NEXT_TOKEN = -1
"""Stands for the turn's first token after the prefix: the cache model then counts every id of the
prefix it holds (it never counts a prompt's last id as cached, which the server computes again)."""


async def stable_prefix(estimator: Estimator, config: PrefillConfig, kind: str,
                        body: Mapping[str, Any]) -> tuple[list[int], int]:
    """The ids a warm-up computes (`prefix.py` says which) and how many of them the server holds
    (all of them, possibly: the turn that follows extends them, so none is computed again).
    Raises EstimateError (NotEstimable: the body's fault; PromptTooLong: more than a slot holds,
    found before the ids are decoded)."""
    if is_chat_like(kind):
        so_far, turn = chat_renders(kind, body)
        ids, _ = await estimator.estimate(config, "chat", so_far)
        ids = ids[:common_prefix(ids, await estimator.prompt_ids(config, "chat", turn))]
    else:
        ids, _ = await estimator.estimate(config, kind, body)
    return ids, min(len(ids), estimator.cache.estimate_cached([*ids, NEXT_TOKEN]))


class Warmer:
    """Implements the prefill gate's `WarmHook`: the gate's one loop ticks it with the load and the
    piece sizes the prefill policy gives (rule 15), and wakes when `wake` is set (a piece ended)."""

    def __init__(self, state: ProxyState, estimator: Estimator, feeder: PieceFeeder,
                 wake: asyncio.Event, keep: KeepHook[Any] | None = None) -> None:
        self._state = state
        self._estimator = estimator
        self._feeder = feeder
        self._clock = state.clock
        self.queue = WarmQueue()
        self._flights: dict[str, Flight] = {}  # each warm-up's record facts, until written
        self._lora: dict[str, Any] = {}
        self._pieces: dict[str, asyncio.Task[None]] = {}
        self._done: list[tuple[int, int, float]] = []  # pieces ended, until the gate reads them
        self._wake = wake
        self._keep = keep
        """The keeper of saved KV: a warm-up's prefix a kept file holds is restored, not computed."""
        self.ended = Counter[str]()
        """Warm-ups ended, by outcome (the metrics)."""
        self.computed_tokens = 0
        self.warmed_tokens = 0
        """Prompt tokens of real requests that warm-ups had computed for them."""

    def now(self) -> float:
        return self._clock()

    def isolated(self) -> bool:
        """Whether a client's answers must not show what the server held already (`access`)."""
        return self._state.config.access.isolates_caches

    def knobs(self) -> WarmKnobs:
        return warm_knobs(self._state.config.warm, self._state.config.prefill)

    # ---- the HTTP side -----------------------------------------------------------------------------

    async def submit(self, flight: Flight, kind: str, body: Mapping[str, Any], lora: Any) -> WarmUp:
        """Queue a warm-up of `body` (WarmRefused, EstimateError). `flight` becomes its record.
        The bounds that need no ids are checked before the body is tokenized."""
        self.queue.check_room(flight.client, self.knobs())
        ids, cached = await stable_prefix(self._estimator, self._state.config.prefill, kind, body)
        restorable, cached = await self._restorable(flight, ids, cached)
        now = self._clock()
        warm = WarmUp(id=flight.id, client=flight.client, ids=array("l", ids), cached=cached,
                      submitted=now, restorable=restorable,
                      first_upto=self._estimator.first_piece_floor(ids))
        decisions = self.queue.submit(warm, self.knobs(), now)
        self._flights[warm.id], self._lora[warm.id] = flight, lora if isinstance(lora, list) else None
        self._apply(decisions)
        self._wake.set()
        return warm

    async def _restorable(self, flight: Flight, ids: list[int], cached: int) -> tuple[int, int]:
        """Tokens beyond the cached ones a kept file holds of the prefix (0: none worth a
        restore), and the cached ones again: the keeper's look at the slots may have found
        llama-server restarted (its cache empty) since the estimate."""
        if self._keep is None:
            return 0, cached
        try:
            _, found = await self._keep.restorable(flight, ids, Estimate(len(ids), len(ids) - cached))
        except Exception:  # fail open: computed as usual
            log.exception("asking keep_kv about warm-up %s failed inside slotwise", flight.id)
            return 0, cached
        cached = min(len(ids), self._estimator.cache.estimate_cached([*ids, NEXT_TOKEN]))
        return (min(found.tokens, len(ids) - cached) if found is not None else 0), cached

    def cancel(self, warm_id: str) -> None:
        """KeyError for an unknown id."""
        self._apply(self.queue.cancel(warm_id, self._clock()))
        self._wake.set()

    # ---- the prefill gate's hook -------------------------------------------------------------------

    async def claim(self, flight: Flight, body: dict[str, Any]) -> int:
        """A real request: a warm-up of its conversation ends here, after its piece in flight (so
        the request finds all of it in the slot, and the estimate that follows sees it cached);
        the request's `warmed_tokens` say what warm-ups computed of its prompt. Returns their
        largest piece (0: none), where the request's own pieces may start (`Credit`)."""
        if not self.queue.claimable():
            return 0  # nothing to end or credit: not even a tokenizer call
        try:
            return await self._claim(flight, body)
        except EstimateError:
            return 0
        except Exception:  # fail open: a bug here must not fail the request
            log.exception("ending the warm-ups of %s's conversation failed", flight.id)
            return 0

    async def _claim(self, flight: Flight, body: dict[str, Any]) -> int:
        ids = await self._estimator.prompt_ids(self._state.config.prefill, str(flight.kind), body)
        decisions, wait = self.queue.claim(ids, self._clock())
        self._apply(decisions)
        pieces = [self._pieces[w] for w in wait if w in self._pieces]
        if pieces:  # asyncio.wait: a request whose client leaves does not cancel the piece
            await asyncio.wait(pieces)
        credit = self.queue.credit(ids)
        flight.warmed_tokens, flight.warm_ids = credit.tokens, list(credit.warm_ids)
        self.warmed_tokens += credit.tokens
        self._wake.set()
        return credit.largest_piece

    # ---- the loop ----------------------------------------------------------------------------------

    def tick(self, load: Load, sizer: Sizer) -> float | None:
        """One look at the queue; returns when to look again at the latest."""
        now, knobs = self._clock(), self.knobs()
        self._apply(self.queue.on_tick(load, sizer, knobs, now))
        return self.queue.next_wakeup(load, knobs, now)

    def pieces_in_flight(self) -> int:
        return len(self._pieces)

    def done_pieces(self) -> list[tuple[int, int, float]]:
        done, self._done = self._done, []
        return done

    async def close(self) -> None:
        """At shutdown: every warm-up still pending or running ends (cancelled), with its record."""
        now = self._clock()
        for warm in self.queue.active():
            self._apply(self.queue.cancel(warm.id, now, "slotwise stopped"))
        tasks = list(self._pieces.values())
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- applying decisions ------------------------------------------------------------------------

    def _apply(self, decisions: list[WarmDecision]) -> None:
        for decision in decisions:
            match decision:
                case Feed():
                    self._pieces[decision.warm_id] = asyncio.create_task(
                        self._piece(decision.warm_id, decision.upto),
                        name=f"slotwise-warm-{decision.warm_id}")
                case RestoreKept():
                    self._pieces[decision.warm_id] = asyncio.create_task(
                        self._restore(decision.warm_id), name=f"slotwise-warm-{decision.warm_id}")
                case CancelWarmPiece():
                    task = self._pieces.get(decision.warm_id)
                    if task is not None:
                        task.cancel()
                case Ended():
                    self._write(decision.warm_id)

    async def _piece(self, warm_id: str, upto: int) -> None:
        warm, flight = self.queue.warmups[warm_id], self._flights[warm_id]
        start = self._clock()
        if flight.timer.prefill_started is None:  # others' records see the warm-up's prefill
            flight.timer.prefill_started = start
            self._state.registry.start_prefill(flight, start)
        try:
            result = await self._feeder.feed(warm.ids, upto, self._lora.get(warm_id))
        except PieceError as exc:
            self._apply(self.queue.on_piece_failed(warm_id, str(exc), self._clock()))
            return
        except Exception as exc:  # a bug must not leave the warm-up running
            log.exception("a piece of warm-up %s failed inside slotwise", warm_id)
            self._apply(self.queue.on_piece_failed(
                warm_id, f"internal error: {type(exc).__name__}: {exc}", self._clock()))
            return
        finally:
            self._pieces.pop(warm_id, None)
            self._wake.set()
        now = flight.timer.prefill_done = self._clock()
        self._estimator.learn(warm.ids[:upto], result.cache_n)
        if self._keep is not None:  # no restore takes the slot from the turn that continues it
            self._keep.warmed(warm.ids[:upto])
        self._done.append((result.prompt_n, result.cache_n, result.batch_ms))
        self._apply(self.queue.on_piece_done(warm_id, result.prompt_n, result.batch_ms,
                                             self.knobs(), now))

    async def _restore(self, warm_id: str) -> None:
        """Rule 10 of the queue: in flight like a piece (the policy counts it as one: a slot, and
        the one piece in flight)."""
        warm, flight, keep = self.queue.warmups[warm_id], self._flights[warm_id], self._keep
        assert keep is not None, "a warm-up is restorable only with a keeper (_restorable)"
        try:
            restored = await keep.restore(flight, list(warm.ids))
        finally:
            self._pieces.pop(warm_id, None)
            self._wake.set()
        now = self._clock()
        if restored.done:
            upto = len(warm.ids) - restored.est.new_tokens
            self._apply(self.queue.on_restored(warm_id, upto, now))
        else:
            log.info("warm-up %s: no restore (%s): computed instead", warm_id, restored.problem)
            self._apply(self.queue.on_restore_failed(warm_id, now))

    def _write(self, warm_id: str) -> None:
        """The warm-up's one record: written once, whatever ended it."""
        flight, warm = self._flights.pop(warm_id, None), self.queue.warmups.get(warm_id)
        self._lora.pop(warm_id, None)
        if flight is None or warm is None:
            return
        record = ended_warm_record(flight, warm, self._state.registry, self._clock())
        self._state.emit(record)
        self.ended[record.outcome] += 1
        self.computed_tokens += warm.computed
