"""The one loop acting on llama-server's time: the warm-ups' and the keeper's turn (`sharers.py`),
then the policy's tick at its next wakeup; the gate's decisions, a request's phase, a warm piece's
end or a look wake it. A wake-up its tick did not move (a policy bug) costs a tick every
STUCK_PAUSE_S, said once in the log, never a core spinning beside llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from proxy.prefill.policy import STUCK_PAUSE_S, PrefillPolicy
from proxy.prefill.sharers import Sharers

log = logging.getLogger("slotwise.prefill")


class WakeLoop:
    def __init__(self, policy: PrefillPolicy, sharers: Sharers, clock: Callable[[], float],
                 wake: asyncio.Event, tick: Callable[[], None]) -> None:
        self._policy = policy
        self._sharers = sharers
        self._clock = clock
        self._wake = wake
        self._tick = tick
        """The policy's tick, its decisions applied (the gate's)."""
        self._warned_stuck = False

    async def run(self) -> None:
        overdue: float | None = None  # the last wake-up found already past
        while True:
            self._wake.clear()
            sharers_at = self._sharers.tick()
            wakeup = min((t for t in (self._policy.next_wakeup(), sharers_at) if t is not None),
                         default=None)
            delay = None if wakeup is None else wakeup - self._clock()
            if delay is None or delay > 0:
                overdue = None
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that
                # comes with a wake-up, and this loop would then never stop.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
            elif wakeup is not None and wakeup == overdue:  # its tick moved nothing: never spin
                self._stuck(wakeup)
                await asyncio.sleep(STUCK_PAUSE_S)
            else:
                overdue = wakeup
                await asyncio.sleep(0)  # never starve the handlers, even when overdue
            if wakeup is not None and self._clock() >= wakeup:
                self._tick()

    def _stuck(self, wakeup: float) -> None:
        if not self._warned_stuck:
            self._warned_stuck = True
            log.warning("prefill: a wake-up %.3f s past still asked for after its tick (a policy "
                        "bug): the loop now waits %g s between such ticks; state: %s",
                        self._clock() - wakeup, STUCK_PAUSE_S, self._policy.snapshot())
