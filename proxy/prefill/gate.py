"""The prefill gate: the one place where the policy's decisions become I/O.

It estimates each request (whenever a feature needs it: `chunk`, `defer`, or kept KV), asks the
keeper what a kept file could spare it, tells the pure `PrefillPolicy` what happened (arrivals,
phase changes from the registry, pieces, restores, clients leaving, ticks) and applies what it
answers: a future per held request, a task per piece or restore in flight, and the one background
loop that acts on llama-server's time (`wake_loop.py`): it ticks the policy at its next wakeup and
gives the warm-ups and the keeper's looks and saves their turn (`sharers.py`). The keeper and the
warm-ups come in as constructor arguments (`hooks.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.config import PrefillConfig
from proxy.estimate import Estimate, EstimateError, PromptTooLong
from proxy.prefill.deciding import QUIET_REASONS
from proxy.prefill.estimator import Estimator
from proxy.prefill.events import (
    Admit,
    CancelPiece,
    Decision,
    FeedPiece,
    Forward,
    Reject,
    Restore,
    Save,
)
from proxy.prefill.feeder import PieceError, PieceFeeder
from proxy.prefill.hooks import KeepHook, Restored, WarmHook
from proxy.prefill.policy import PrefillPolicy
from proxy.prefill.sharers import Sharers
from proxy.prefill.snapshot import PolicySnapshot
from proxy.prefill.wake_loop import WakeLoop
from proxy.record.flight import Flight, Phase, PrefillPlan
from proxy.record.inflight import Registry
from proxy.record.kind import Kind
from proxy.request.endpoints import GENERATING
from proxy.request.errors import Rejected

log = logging.getLogger("slotwise.prefill")

Release = Admit | Forward | Reject
"""How a request leaves the gate."""


@dataclass(eq=False)
class _Request:
    """A request the gate is deciding about, until it is sent or turned away."""

    key: str
    flight: Flight
    ids: list[int]
    lora: Any
    release: asyncio.Future[Release] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    piece: asyncio.Task[None] | None = None
    restore: asyncio.Task[None] | None = None
    logged: tuple[str, int] | None = None
    """The strategy and piece-size band last logged at info (`_log_choice`)."""


class PrefillGate:
    """Implements `proxy.request.admission.Gate` with a `PrefillPolicy`."""

    def __init__(self, *, config: PrefillConfig, estimator: Estimator,
                 feeder: PieceFeeder, registry: Registry,
                 clock: Callable[[], float] = time.monotonic,
                 policy: PrefillPolicy | None = None, keep: KeepHook[Any] | None = None,
                 warm: WarmHook | None = None, wake: asyncio.Event | None = None) -> None:
        self._cfg = config
        self._policy = policy if policy is not None else PrefillPolicy(config,
                                                                       n_batch=config.n_batch)
        self._estimator = estimator
        self._feeder = feeder
        self._registry = registry
        self._clock = clock
        self._seq = itertools.count(1)
        self._keys: dict[Flight, str] = {}  # requests the policy knows, until they are DONE
        self._ids: dict[str, list[int]] = {}  # their prompt ids, to correct the cache model
        self._deciding: dict[str, _Request] = {}
        self._wake = wake if wake is not None else asyncio.Event()
        """Set by every decision applied, and by the warm-ups when their pieces end."""
        self._warm = warm
        """Ends this conversation's warm-up before the estimate (its work is then cached)."""
        self._keep = keep
        """What a kept file could spare a request, and its restore when the policy says so; its
        looks at the slots and its saves run in this gate's loop."""
        self._sharers = Sharers(self._policy, clock, self._wake, self._apply, keep=keep, warm=warm)
        """The warm-ups and the keeper's looks and saves, in this gate's loop."""
        self._wake_loop = WakeLoop(self._policy, self._sharers, clock, self._wake, self.tick)

    @property
    def policy(self) -> PrefillPolicy:
        return self._policy

    def snapshot(self) -> PolicySnapshot:
        return self._policy.snapshot()

    async def admit(self, flight: Flight, body: dict[str, Any]) -> None:
        """Return when the request may go upstream. What was done with it is written on
        `flight.prefill` as it happens, so a client that leaves meanwhile still has it."""
        if flight.kind not in GENERATING:
            return
        ramp_from = 0  # a warm-up's largest piece of this prompt (the policy's rule 15)
        if self._warm is not None:  # warm (proxy/warm): its work is then in the cache model
            ramp_from = await self._warm.claim(flight, body)
        cfg = self._cfg
        key = f"{flight.id}#{next(self._seq)}"
        if cfg.mode == "off" and self._keep is None:  # no estimate: zero added latency
            self._keys[flight] = key
            self._apply(self._policy.on_arrival(key, 0, 0, self._clock(),
                                                background=cfg.is_background(flight.purpose)))
            return
        ids, est, note = await self._estimate(cfg, flight.kind, body)
        restorable = None
        if self._keep is not None and ids:  # keep_kv (proxy/keep)
            est, restorable = await self._keep.restorable(flight, ids, est)
        layout = self._estimator.layout
        self._policy.set_layout(layout.slots, layout.shared_kv)
        self._sharers.sync_warm()
        request = _Request(key=key, flight=flight, ids=ids, lora=body.get("lora"))
        self._deciding[key] = request
        self._keys[flight] = key
        facts = flight.prefill
        facts.note = note
        if ids:
            self._ids[key] = ids
            facts.est_prompt_tokens, facts.est_new_tokens = est.prompt_tokens, est.new_tokens
        start = self._clock()
        try:
            self._apply(self._policy.on_arrival(
                key, est.new_tokens if ids else 0, est.prompt_tokens if ids else 0, start,
                restorable, first_upto=self._estimator.first_piece_floor(ids),
                background=cfg.is_background(flight.purpose), guessed_tokens=est.guessed_tokens,
                ramp_from=ramp_from))
            release = await self._wait(request, flight, start)
        finally:
            self._deciding.pop(key, None)
            facts.slot_wait_ms = round(self._policy.slot_wait_s(key) * 1000.0, 1)
        if isinstance(release, Reject):
            raise Rejected(f"slotwise is holding too many cold prompts: {release.reason}")
        if release.reason not in QUIET_REASONS:
            facts.note = note or release.reason

    async def _estimate(self, cfg: PrefillConfig, kind: Kind, body: Mapping[str, Any]
                        ) -> tuple[list[int], Estimate, str | None]:
        """Fail open: a request that cannot be estimated is admitted as not cold, with a note; so
        is one longer than a slot holds (llama-server answers it with its own error at once:
        feeding it in pieces would only spend everyone's time first)."""
        try:
            ids, est = await self._estimator.estimate(cfg, kind, body)
        except PromptTooLong as exc:  # the estimator found it before decoding its ids
            return [], Estimate(0, 0), _too_long(exc.tokens, exc.slot_ctx)
        except EstimateError as exc:
            return [], Estimate(0, 0), f"not estimated, forwarded as it came: {exc}"
        slot_ctx = self._estimator.layout.slot_ctx
        if slot_ctx is not None and len(ids) > slot_ctx:
            return [], Estimate(0, 0), _too_long(len(ids), slot_ctx)
        return ids, est, None

    async def _wait(self, request: _Request, flight: Flight, start: float) -> Release:
        if request.release.done():
            return request.release.result()
        if flight.prefill.plan is PrefillPlan.NONE:
            flight.prefill.plan = PrefillPlan.HELD
        self._registry.move(flight, Phase.HELD, start)
        try:
            return await request.release
        except asyncio.CancelledError:  # the client left: end its plan at once
            for task in (request.piece, request.restore):
                if task is not None:
                    task.cancel()
            self._apply(self._policy.on_client_left(request.key, self._clock()))
            raise
        finally:
            flight.prefill.held_ms = round((self._clock() - start) * 1000.0, 1)

    # ---- events from the registry ------------------------------------------------------------

    def on_phase(self, flight: Flight, old: Phase, new: Phase, now: float) -> None:
        """Registry listener: prefill started, first token, finished (with the server's figures)."""
        key = self._keys.get(flight)
        if key is None:
            return
        if new is Phase.PREFILLING:
            self._apply(self._policy.on_prefill_started(key, now))
        elif new is Phase.DECODING:
            self._apply(self._policy.on_first_token(key, now))
        elif new is Phase.DONE:
            del self._keys[flight]
            self._finished(key, flight, now)

    def _finished(self, key: str, flight: Flight, now: float) -> None:
        prompt_n, total = flight.computed_tokens, flight.prompt_tokens
        ids = self._ids.pop(key, None)
        if ids and prompt_n is not None and total is not None:
            generated = (flight.timings or {}).get("predicted_n")
            self._estimator.learn(ids, total - prompt_n,
                                  generated if isinstance(generated, int) else 0)
        self._apply(self._policy.on_finished(key, now, prompt_n, _prompt_ms(flight),
                                             cache_n=max(0, (total or 0) - (prompt_n or 0))))

    # ---- applying decisions --------------------------------------------------------------------

    def _apply(self, decisions: list[Decision]) -> None:
        for decision in decisions:
            match decision:
                case Admit() | Forward() | Reject():
                    self._settle(decision)
                case FeedPiece():
                    self._start_piece(decision)
                case Restore():
                    self._start_restore(decision)
                case Save():
                    self._sharers.start_save(decision)
                case CancelPiece():
                    request = self._deciding.get(decision.req_id)
                    if request is not None and request.piece is not None:
                        request.piece.cancel()
        self._wake.set()

    def _settle(self, decision: Release) -> None:
        request = self._deciding.get(decision.req_id)
        if request is not None and not request.release.done():
            request.release.set_result(decision)

    def _start_piece(self, decision: FeedPiece) -> None:
        request = self._deciding.get(decision.req_id)
        if request is None:  # cannot happen: the policy feeds only requests it holds
            log.error("the policy fed a piece of %s, which the gate does not hold", decision.req_id)
            return
        self._log_choice(request)
        request.piece = asyncio.create_task(
            self._piece(request, decision.upto_tokens, decision.trim),
            name=f"slotwise-piece-{request.key}")

    def _start_restore(self, decision: Restore) -> None:
        request = self._deciding.get(decision.req_id)
        if request is None or self._keep is None:  # cannot happen: only asked for with a keeper
            log.error("the policy restored %s, which the gate cannot", decision.req_id)
            return
        request.restore = asyncio.create_task(self._restore(request, self._keep),
                                              name=f"slotwise-restore-{request.key}")

    async def _restore(self, request: _Request, keep: KeepHook[Any]) -> None:
        restored: Restored = await keep.restore(request.flight, request.ids)
        facts, now = request.flight.prefill, self._clock()
        if restored.done:
            facts.est_new_tokens = restored.est.new_tokens
            self._apply(self._policy.on_restored(request.key, restored.est.new_tokens, now))
        else:
            self._apply(self._policy.on_restore_failed(request.key, restored.problem or "failed",
                                                       now, no_slot=restored.no_slot))

    def _log_choice(self, request: _Request) -> None:
        """One line when a cold request's way on changes (a strategy, or a piece size band), so the
        operator's log says what the batch cost made of this server; every piece at debug."""
        choice = self._policy.snapshot().choice
        if choice is None:
            return
        what = (choice.strategy.value, choice.piece_tokens.bit_length())
        level = logging.INFO if what != request.logged else logging.DEBUG
        request.logged = what
        log.log(level, "prefill %s: %s of %d tokens (~%.0f ms predicted): %s", request.key,
                choice.strategy.value, choice.piece_tokens, choice.predicted_piece_ms, choice.reason)

    async def _piece(self, request: _Request, upto: int, trim: bool = False) -> None:
        # The prompt's computation starts with its first piece: from then on it is a prefill
        # that others' records see overlapping them.
        self._registry.start_prefill(request.flight, self._clock())
        try:
            result = await self._feeder.feed(request.ids, upto, request.lora)
        except PieceError as exc:
            self._apply(self._policy.on_piece_failed(request.key, str(exc), self._clock()))
            return
        except Exception as exc:  # a bug must not leave the request held: fail open
            log.exception("piece of %s failed inside slotwise", request.key)
            self._apply(self._policy.on_piece_failed(
                request.key, f"internal error: {type(exc).__name__}: {exc}", self._clock()))
            return
        facts = request.flight.prefill
        if trim:  # rule 19: no piece of its prompt fed ahead, one token computed again
            facts.plan = PrefillPlan.TRIMMED
        else:
            facts.plan, facts.pieces = PrefillPlan.CHUNKED, facts.pieces + 1
            facts.fed_tokens += result.prompt_n
        self._estimator.learn(request.ids[:upto], result.cache_n)
        self._apply(self._policy.on_piece_done(request.key, result.prompt_n, result.batch_ms,
                                               self._clock()))

    # ---- time and reloads ----------------------------------------------------------------------

    def reconfigure(self, config: PrefillConfig) -> None:
        """A reload's `[prefill]`: it rules new requests and the policy from now on (held requests
        stay held, or are released if the mode is now `off`)."""
        if config != self._cfg:
            self._cfg = config
            self._apply(self._policy.reconfigure(config, self._clock()))

    def tick(self) -> None:
        self._apply(self._policy.on_tick(self._clock()))

    async def run(self) -> None:
        """The one loop acting on llama-server's time (wake_loop.py); runs until cancelled."""
        await self._wake_loop.run()

    async def close(self) -> None:
        """Stop the pieces in flight (their connections close; the server cancels them)."""
        tasks = [task for r in self._deciding.values() for task in (r.piece, r.restore)
                 if task is not None and not task.done()]
        tasks += self._sharers.tasks()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_ms(flight: Flight) -> float | None:
    """The request's prefill time: the server's `timings.prompt_ms`, else as the stream showed it."""
    server = (flight.timings or {}).get("prompt_ms")
    if isinstance(server, int | float):
        return float(server)
    timer = flight.timer
    return timer.ms(timer.prefill_started, timer.prefill_done)


def _too_long(tokens: int, slot_ctx: int) -> str:
    return (f"the prompt's {tokens:,} tokens are more than a slot holds ({slot_ctx:,}): "
            "forwarded as it came, no piece fed")
