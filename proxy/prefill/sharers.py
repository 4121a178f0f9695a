"""The users of llama-server's time besides the requests, as the gate's one loop drives them: the
warm-ups (their queue ticked under the `Load` the policy gives, their pieces told to the policy)
and the keeper's looks at the slots and its saves (a save goes only when the policy lets it: rule
16). The decisions the policy answers go back to the gate (`apply`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from proxy.prefill.events import Decision, Save
from proxy.prefill.hooks import DueSave, KeepHook, WarmHook
from proxy.prefill.policy import PrefillPolicy

log = logging.getLogger("slotwise.prefill")


class Sharers:
    def __init__(self, policy: PrefillPolicy, clock: Callable[[], float], wake: asyncio.Event,
                 apply: Callable[[list[Decision]], None], *, keep: KeepHook[Any] | None,
                 warm: WarmHook | None) -> None:
        self._policy = policy
        self._clock = clock
        self._wake = wake
        self._apply = apply
        self._keep = keep
        self._warm = warm
        self._look: asyncio.Task[None] | None = None
        self._saves: dict[str, tuple[DueSave, asyncio.Task[None] | None]] = {}

    def tick(self) -> float | None:
        """The warm-ups' turn and the keeper's; when either wants the next at the latest."""
        return min((t for t in (self._tick_warm(), self._tick_keep()) if t is not None),
                   default=None)

    # ---- warm-ups (rule 15) ------------------------------------------------------------------

    def sync_warm(self) -> None:
        """Tell the policy what the warm-ups' pieces did."""
        if self._warm is None:
            return
        for prompt_n, cache_n, batch_ms in self._warm.done_pieces():
            self._policy.on_warm_piece_done(prompt_n, cache_n, batch_ms)
        decisions = self._policy.on_warm_pieces(self._warm.pieces_in_flight(), self._clock())
        if decisions:
            self._apply(decisions)

    def _tick_warm(self) -> float | None:
        """The warm-up queue's turn, under what the policy says real requests are doing."""
        if self._warm is None:
            return None
        self.sync_warm()
        policy = self._policy
        wakeup = self._warm.tick(policy.warm_load(self._clock()), policy.warm_sizer())
        self.sync_warm()  # a piece it just started counts at once
        return wakeup

    # ---- the keeper's looks and saves (rule 16) ----------------------------------------------

    def _tick_keep(self) -> float | None:
        """A look at the slots when the keeper wants one (none while one runs or a save does)."""
        keep = self._keep
        if keep is None or self._look is not None or self._saves:
            return None
        in_s = keep.next_look_in(quiet=self._policy.save_ok())
        if in_s is None:
            return None
        if in_s > 0:
            return self._clock() + in_s
        self._look = asyncio.create_task(self._look_at_slots(keep), name="slotwise-keep-look")
        return None

    async def _look_at_slots(self, keep: KeepHook[Any]) -> None:
        try:
            save = await keep.look(quiet=self._policy.save_ok())
        finally:
            self._look = None
            self._wake.set()
        if save is None:
            return
        key = f"save-{save.name}"
        decisions = self._policy.on_save_due(key, self._clock())
        if not decisions:  # somebody came meanwhile: the server is not quiet now
            keep.save_dropped(save)
            return
        self._saves[key] = (save, None)
        self._apply(decisions)

    def start_save(self, decision: Save) -> None:
        entry = self._saves.get(decision.req_id)
        if entry is None or self._keep is None:  # cannot happen: only asked for with a keeper
            log.error("the policy saved %s, which the gate cannot", decision.req_id)
            return
        task = asyncio.create_task(self._save(decision.req_id, entry[0], self._keep),
                                   name=f"slotwise-{decision.req_id}")
        self._saves[decision.req_id] = (entry[0], task)

    async def _save(self, key: str, save: DueSave, keep: KeepHook[Any]) -> None:
        started = self._clock()
        try:
            await keep.save(save)
        except Exception:  # a bug must not keep the server counted busy
            log.exception("keep_kv: saving %s failed inside slotwise", save.name)
        finally:
            self._saves.pop(key, None)
            now = self._clock()
            self._apply(self._policy.on_save_done(key, (now - started) * 1000.0, now))

    def tasks(self) -> list[asyncio.Task[None]]:
        """The look and the save in flight (to stop at shutdown)."""
        saves = [task for _, task in self._saves.values() if task is not None]
        return [t for t in (*saves, self._look) if t is not None and not t.done()]
