"""The replay's one clock: a heap of timed actions (earliest first, then in the order they were
placed), the actions waiting for a request's end (a client's next turn, the chat app's warm-up
call: sent their pause after it ends in the what-if), and the wake-ups the prefill policy and the
warm-up queue ask for, placed as the gate's loop places them. Pure: the time is simulated.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from proxy.prefill.policy import STUCK_PAUSE_S

Act = Callable[[float], None]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Act]] = []
        self._seq = itertools.count()
        self._after: dict[str, list[tuple[float, Act]]] = {}
        """What a client sends after the request it names ended, by its id, with its pause."""

    def at(self, t: float, act: Act) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), act))

    def when(self, after: str | None, arrival: float, think_s: float, act: Act) -> None:
        """At its logged time, or `think_s` after the request `after` ends in the replay."""
        if after is None:
            self.at(arrival, act)
        else:
            self._after.setdefault(after, []).append((think_s, act))

    def ended(self, request_id: str, now: float) -> None:
        """A request ended: what its client sends next comes its pause later."""
        for think_s, act in self._after.pop(request_id, ()):
            self.at(now + think_s, act)

    @property
    def next_at(self) -> float:
        """When the earliest action is due (infinity: none left)."""
        return self._heap[0][0] if self._heap else float("inf")

    def run_next(self) -> None:
        """The earliest action, at its time."""
        t, _, act = heapq.heappop(self._heap)
        self.now = t
        act(t)

    def __bool__(self) -> bool:
        return bool(self._heap)


class Wakeups:
    """The times the policy's tick and the warm-up queue's turn are due, as timed actions. The
    warm-up queue has its turn after every event anyway (the replay's loop), so its wake-up only
    makes sure an event happens then."""

    def __init__(self, clock: Clock, policy_wakeup: Callable[[], float | None],
                 policy_tick: Act, warm_wakeup: Callable[[float], float | None]) -> None:
        self._clock = clock
        self._policy_wakeup, self._policy_tick, self._warm_wakeup = (policy_wakeup, policy_tick,
                                                                     warm_wakeup)
        self._tick_at: float | None = None
        self._ticked_for: float | None = None  # the wake-up the last tick was for, and when
        self._ticked_at = 0.0
        self._warm_at: float | None = None

    def schedule(self) -> None:
        now = self._clock.now
        warm = self._warm_wakeup(now)
        if warm is not None and (self._warm_at is None or warm < self._warm_at):
            self._warm_at = warm
            self._clock.at(warm, self._warm_woke)
        wake = self._policy_wakeup()
        if wake is not None and wake == self._ticked_for:  # as the gate's loop: never back to back
            wake = max(wake, self._ticked_at + STUCK_PAUSE_S)
        if wake is None or (self._tick_at is not None and self._tick_at <= wake):
            return
        self._tick_at = wake = max(wake, now)
        self._clock.at(wake, self._tick)

    def _warm_woke(self, now: float) -> None:
        if self._warm_at is not None and now >= self._warm_at:
            self._warm_at = None

    def _tick(self, now: float) -> None:
        if self._tick_at is not None and now < self._tick_at:
            return
        self._tick_at = None
        wake = self._policy_wakeup()
        if wake is not None and now >= wake:
            self._ticked_for, self._ticked_at = wake, now
            self._policy_tick(now)
