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
from proxy.prefill.sizing import TILE_ROWS

Place = tuple[bool, float]

LANDING_MAX_S = 2.0
"""How long, at most, the others wait for a restored (or trimmed) request sent into its slot to
have its first token, and for a trim piece to end. Until its prompt starts, a request sent beside
it could take its slot; until its first token, a prompt sent beside it shares its batch (bench
day: a held translation's 652 tokens, sent 0.5 s after `eve`'s restored turn whose prompt had not
yet started, made her 64 tokens take 1.27 s). A short rest's first token beside three streams
comes within ~1 s here (the prompt starts 0.1-0.7 s after it is sent); the bound is for a request
that never shows it."""


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
        """Restored or trimmed requests sent, until their first token, and trim pieces in flight
        (each at most LANDING_MAX_S)."""
        self._started: set[str] = set()
        """Of those, the ones whose prompt started."""

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

    def claimed(self, now: float, taken: int, new_tokens: int | None = None) -> bool:
        """Rule 14: a restore runs (bench day: eve's restore, with a translation sent as it
        started, took 17.8 s), or a restored request is landing in its slot (for a request of
        `new_tokens` more than a tile once its prompt started: `landing`), or a restore waits and
        no slot is free besides."""
        return bool(self.restores.running() or self.landing(now, new_tokens)
                    or (self.restores and self.free(taken) <= 0))

    def landing(self, now: float, new_tokens: int | None = None) -> bool:
        """A restored request sent holds the others back: until its prompt starts, all (they could
        take its slot: bench day, a translation did, and eve waited 5.7 s more for another); then,
        until its first token, a prompt of more than TILE_ROWS new tokens (`new_tokens`; unknown:
        held), which would share its batch. A short one adds about nothing to that batch and
        goes."""
        for req_id, until in list(self._landing.items()):
            if now >= until:
                del self._landing[req_id]
                self._started.discard(req_id)
        small = new_tokens is not None and new_tokens <= TILE_ROWS
        return any(r not in self._started or not small for r in self._landing)

    def why_held(self) -> str:
        if self.restores.running():
            return "waiting for a restore to end"
        if self._landing:
            return "waiting for a restored or trimmed turn's first token"
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
        if not self.behind or self.full(taken):
            return None
        first = min(self.behind, key=lambda i: place(self.behind[i][0], now, patience_s))
        if self.claimed(now, taken, self.behind[first][0].est_new_tokens):
            return None
        req, why, _ = self._leave_behind(first, now)
        return req, why

    def _leave_behind(self, req_id: str, now: float) -> tuple[Arrived, str, float]:
        """It leaves the line; what it waited there adds to `waited`."""
        req, why, since = self.behind.pop(req_id)
        self.waited[req_id] = self.waited.get(req_id, 0.0) + max(0.0, now - since)
        return req, why, since

    def land(self, req_id: str, now: float, *, started: bool = False) -> None:
        """A restored or trimmed request was sent: the others wait until its first token.
        `started`: a trim piece, sent ahead of its turn into the slot that holds its history: a
        prompt of a tile may join its batch at once, a longer one waits for the turn's first
        token (bench day: a 652-token translation sent beside `eve`'s one-token trim piece after
        her restore made the piece take 1.2 s, not ~0.2)."""
        self._landing[req_id] = now + LANDING_MAX_S
        if started:
            self._started.add(req_id)
        else:
            self._started.discard(req_id)

    def prompt_started(self, req_id: str) -> bool:
        """Its prompt started; whether it was landing (short prompts may go now)."""
        if req_id not in self._landing:
            return False
        self._started.add(req_id)
        return True

    def landed(self, req_id: str) -> bool:
        """Its first token came (or it ended); whether it was landing."""
        self._started.discard(req_id)
        return self._landing.pop(req_id, None) is not None

    def left(self, req_id: str, now: float) -> bool:
        """Its client left; whether it was waiting for a slot."""
        self.landed(req_id)
        if req_id in self.behind:
            self._leave_behind(req_id, now)
            return True
        return self.restores.pop(req_id) is not None

    def next_wakeup(self) -> float | None:
        """A restore's wait running out, or a landing's bound ending with somebody behind it."""
        landing = min(self._landing.values(), default=None) if self.behind else None
        times = [t for t in (self.restores.next_wakeup(), landing) if t is not None]
        return min(times, default=None)
