"""Who gets llama-server's next free slot, as the prefill policy decides it (its rules 12 and 14):
the server's slot count, the restores waiting for a slot, the requests held until one frees, and
the restored requests landing in theirs. Pure data with a little arithmetic; the policy counts the
other slot users (requests sent, kept plans, warm-up pieces, a save) and decides.

Once every slot is used, a request sent would only queue inside llama-server, which then gives the
next slot to whoever it queued first, a restore's task or a short turn alike; held here, the
policy chooses: a returning conversation's restore first, then the others in arrival order, a
background job after the chat turns for a while (`place`).
"""

from __future__ import annotations

from proxy.prefill.events import Arrived
from proxy.prefill.restores import RestoreLine
from proxy.prefill.server_use import SENT_GRACE_S

Place = tuple[bool, float]


def place(req: Arrived, now: float, patience_s: float) -> Place:
    """Where `req` stands for a free slot (rule 12), the lowest first: in arrival order, but a
    background job (its purpose) lets the chat turns go first until it has waited `patience_s`
    since it arrived (nobody reads its answer as it comes; bench day: a translation took the slot a
    short chat turn had waited 20 s for)."""
    return req.background and now - req.now < patience_s, req.now


class SlotLine:
    def __init__(self, slots: int | None = None) -> None:
        self.slots = slots
        """The server's slot count (`/props`); None until known."""
        self.restores = RestoreLine()
        self.behind: dict[str, tuple[Arrived, str, float]] = {}
        """Held until a slot is free and none is claimed for a restore, in arrival order, with
        why they were held and since when."""
        self.waited: dict[str, float] = {}
        """Seconds each request spent held behind, once it left (the record's `slot_wait_ms`;
        the policy hands it out)."""
        self._landing: dict[str, float] = {}
        """Restored requests sent, until their prompt starts (at most SENT_GRACE_S)."""

    def __bool__(self) -> bool:
        """Somebody waits for a slot (a restore, or a request held behind)."""
        return bool(self.restores or self.behind)

    def held(self) -> tuple[str, ...]:
        return tuple(self.restores.waiting) + tuple(self.behind)

    # ---- counting ----------------------------------------------------------------------------

    def free(self, taken: int) -> int:
        """Slots free besides the `taken` ones and the restores running; unknown slots: one is
        taken to be free (a restore then finds out, and nobody is held for a slot)."""
        if self.slots is None:
            return 1
        return self.slots - taken - self.restores.running()

    def full(self, taken: int) -> bool:
        return self.slots is not None and self.free(taken) <= 0

    def claimed(self, now: float, taken: int) -> bool:
        """Rule 14: a restore runs, or a restored request is landing in its slot, or a restore
        waits and no slot is free besides."""
        for req_id, until in list(self._landing.items()):
            if now >= until:
                del self._landing[req_id]
        return bool(self.restores.running() or self._landing
                    or (self.restores and self.free(taken) <= 0))

    def why_held(self) -> str:
        if self.restores.running() or self._landing:
            return "waiting for a restore to end"
        if self.restores:
            return "waiting behind a restore into the next free slot"
        return f"waiting for a free slot ({self.slots} of {self.slots} in use)"

    # ---- events ------------------------------------------------------------------------------

    def hold(self, req: Arrived, now: float) -> str:
        """Hold it until a slot is free for it; why."""
        why = self.why_held()
        self.behind[req.req_id] = (req, why, now)
        return why

    def first_place(self, now: float, patience_s: float) -> Place | None:
        """The place of the one the next free slot goes to (`place`); None if nobody is held."""
        return min((place(req, now, patience_s) for req, _, _ in self.behind.values()),
                   default=None)

    def next_behind(self, now: float, taken: int,
                    patience_s: float) -> tuple[Arrived, str] | None:
        """The one held whose turn it is (`place`) and why, if a slot is free for it now (it
        leaves the line)."""
        if not self.behind or self.claimed(now, taken) or self.full(taken):
            return None
        first = min(self.behind, key=lambda i: place(self.behind[i][0], now, patience_s))
        req, why, _ = self._leave_behind(first, now)
        return req, why

    def _leave_behind(self, req_id: str, now: float) -> tuple[Arrived, str, float]:
        """It leaves the line; what it waited there adds to `waited`."""
        req, why, since = self.behind.pop(req_id)
        self.waited[req_id] = self.waited.get(req_id, 0.0) + max(0.0, now - since)
        return req, why, since

    def land(self, req_id: str, now: float) -> None:
        """A restored request was sent: the others wait until its prompt starts."""
        self._landing[req_id] = now + SENT_GRACE_S

    def landed(self, req_id: str) -> bool:
        """Its prompt started (or it ended); whether it was landing."""
        return self._landing.pop(req_id, None) is not None

    def left(self, req_id: str, now: float) -> bool:
        """Its client left; whether it was waiting for a slot."""
        self._landing.pop(req_id, None)
        if req_id in self.behind:
            self._leave_behind(req_id, now)
            return True
        return self.restores.pop(req_id) is not None

    def next_wakeup(self) -> float | None:
        """A restore's wait running out, or a landing's grace ending with somebody behind it."""
        landing = min(self._landing.values(), default=None) if self.behind else None
        times = [t for t in (self.restores.next_wakeup(), landing) if t is not None]
        return min(times, default=None)
