"""The warm-up queue: which warm-up computes which piece when, and how each one ends.

Pure and synchronous, like the prefill policy: events in, decisions out; every call takes `now`; no
I/O, no clock, no log. The `Warmer` applies the decisions (feeds the pieces, writes the records) and
tells the queue what happened. What the real requests are doing comes in as a `Load`, the piece
size from a `Sizer` (the prefill policy's fitted batch cost); when a piece may start and where it
ends is `pieces.py`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from proxy.prefill.events import Load, Sizer
from proxy.record.outcome import Outcome
from proxy.warm.pieces import may_start, piece_done, piece_end
from proxy.warm.prefix import common_prefix, same_conversation
from proxy.warm.values import (
    CancelWarmPiece,
    Credit,
    Ended,
    Feed,
    RestoreKept,
    WarmDecision,
    WarmKnobs,
    WarmRefused,
    WarmUp,
)

MIN_TOKENS = 64
"""A warm-up with fewer tokens to compute ends at once (done): the server holds its prompt already,
and the turn computes so few itself."""
KEEP_ENDED = 64
"""Ended warm-ups kept (for `GET`, and to credit a later turn with their work), newest first."""


@dataclass
class WarmQueue:
    """Rules (tests/test_warm_queue.py follows them one to one):
     1. A warm-up with fewer than MIN_TOKENS to compute ends at once, done: the server holds its
        prompt already (the cache model), and it costs nothing.
     2. A new warm-up of the same conversation as one pending or running (its prefix carries
        SAME_SHARE of the older one's) supersedes it.
     3. Bounds: at most `max_pending` pending or running (one that is ending after its piece does
        not count), at most `max_per_client` of them per named client, else WarmRefused; a warm-up
        computes at most `max_tokens` tokens (a longer prefix is cut, and says so). While
        `max_pending` are pending or running and none of them is its client's, a warm-up is
        refused before its body is tokenized (`check_room`): it could get in only by superseding
        another client's warm-up (rule 2), which is not worth the tokenizer's work for every
        refused call.
     4. One runs at a time, to its end; then the pending one with the fewest tokens to compute
        (then the oldest).
     5. The lowest priority: no piece starts while a real cold request is held or fed, nor just
        after a real request was sent (its prompt starts alone), nor while every slot is taken
        (it would wait in llama-server's queue and take the next free slot before the requests
        held for one). A piece may join a batch where a
        real prompt is computed: sized to `max_stall_ms`, it adds at most that to the prompt's time
        (yielding to every prompt, as it once did, starved it on a busy day: bench day warmed 56
        of a post-summary prompt's 2,479 tokens in the user's 4-8 s of typing).
     6. While others generate, each piece is followed by a pause of piece_time × (1 - share) /
        share, as `chunk` does, share = `knobs.prefill_share` (`warm_share`: at least a cold
        request's behind its bound); on an idle server pieces go back to back. The size is the
        Sizer's.
     7. A real request of the same conversation ends a pending or running warm-up (superseded) once
        its piece in flight is done, so that the request finds all of it in the slot; it is credited
        with the tokens warm-ups computed of its prompt, each warm-up once, and with their largest
        piece (its own pieces, if it has any, need not ramp up from a small one again).
     8. A warm-up not ended `expire_s` after it was asked for expires (after its piece in flight);
        an ended one is kept for crediting and `GET` until `expire_s` after its end (KEEP_ENDED).
     9. Cancel ends it at once (its piece in flight is cancelled); a failed piece ends it (failed).
    10. A warm-up a kept file holds MIN_TOKENS or more of (keep_kv, `restorable`; less is not
        worth a restore) restores it first, under rule 5's conditions, in place of its first piece
        and in flight like one; restored, its pieces go on after what the file held (done at once
        with fewer than MIN_TOKENS left); a restore that did not happen (no idle slot, a failure)
        leaves it to compute as usual.
    11. Its first piece ends at `first_upto` at least (`sizing.first_piece_end`: rounded up to a
        multiple of 64, when that is at most FIRST_PIECE_MAX and a quarter of the prefix), as a
        cold request's does (the prefill policy's rule 17): shorter, llama-server would place it
        by its similarity into the slot of another prompt it shares the chat template's head with.
    12. No piece leaves fewer than TILE_ROWS tokens of the prefix after it (`sizing.absorb_tail`):
        they go with it, as a cold request's rest does (the prefill policy's rule 18): a batch of
        fewer rows costs several times more on CPU.
    """

    warmups: dict[str, WarmUp] = field(default_factory=dict)

    # ---- events ------------------------------------------------------------------------------------

    def submit(self, warm: WarmUp, knobs: WarmKnobs, now: float) -> list[WarmDecision]:
        self._forget(knobs, now)
        if warm.restorable < MIN_TOKENS:  # rule 10: not worth a restore
            warm.restorable = 0
        if warm.to_compute < MIN_TOKENS:
            self.warmups[warm.id] = warm
            return self._end(warm, Outcome.DONE, "already cached: nothing to compute", now)
        if warm.to_compute > knobs.max_tokens:
            warm.ids, warm.capped = warm.ids[:warm.cached + knobs.max_tokens], True
        replaced = [w for w in self.active() if self._same(w, warm.ids)]
        self._check_bounds(warm, replaced, knobs)
        out: list[WarmDecision] = []
        for old in replaced:
            out += self._stop(old, Outcome.SUPERSEDED, f"superseded by warm-up {warm.id}", now)
        self.warmups[warm.id] = warm
        return out

    def check_room(self, client: str | None, knobs: WarmKnobs) -> None:
        """Rule 3, the bound that needs no ids: WarmRefused when the queue is full of other
        clients' warm-ups (the anonymous caller counts as one client)."""
        staying = [w for w in self.active() if w.ending is None]
        if len(staying) >= knobs.max_pending and all(w.client != client for w in staying):
            raise _full(len(staying), knobs)

    def on_tick(self, load: Load, sizer: Sizer, knobs: WarmKnobs, now: float) -> list[WarmDecision]:
        out = self._expire(knobs, now)
        warm = self._next()
        if warm is None or warm.piece_upto is not None or warm.ending is not None:
            return out
        if not may_start(warm, load, now):  # rules 5 and 6
            return out
        if warm.restorable and warm.started is None:  # rule 10
            warm.started = now
            warm.piece_upto = min(len(warm.ids), warm.done_upto + warm.restorable)
            return [*out, RestoreKept(warm.id)]
        warm.piece_upto = piece_end(warm, sizer, load)  # rules 6, 11 and 12
        if warm.started is None:
            warm.started = now
        return [*out, Feed(warm.id, warm.piece_upto)]

    def on_piece_done(self, warm_id: str, computed: int, batch_ms: float, knobs: WarmKnobs,
                      now: float) -> list[WarmDecision]:
        warm = self.warmups.get(warm_id)
        if warm is None or warm.outcome is not None or warm.piece_upto is None:
            return []
        piece_done(warm, warm.piece_upto, computed, batch_ms, knobs.prefill_share, now)
        if warm.ending is not None:
            return self._end(warm, *warm.ending, now)
        if warm.done_upto >= len(warm.ids):
            return self._end(warm, Outcome.DONE, "computed", now)
        return []

    def on_restored(self, warm_id: str, upto: int, now: float) -> list[WarmDecision]:
        """Rule 10: the file is in a slot; the server holds the prefix's first `upto` ids."""
        warm = self._restoring(warm_id)
        if warm is None:
            return []
        warm.restored = max(0, upto - warm.done_upto)
        warm.done_upto = max(warm.done_upto, upto)
        if warm.ending is not None:
            return self._end(warm, *warm.ending, now)
        if len(warm.ids) - warm.done_upto < MIN_TOKENS:
            return self._end(warm, Outcome.DONE, f"restored {warm.restored} tokens from a kept "
                                                 "file", now)
        return []

    def on_restore_failed(self, warm_id: str, now: float) -> list[WarmDecision]:
        """Rule 10: no restore after all: its pieces compute the prefix."""
        warm = self._restoring(warm_id)
        if warm is None or warm.ending is None:
            return []
        return self._end(warm, *warm.ending, now)

    def _restoring(self, warm_id: str) -> WarmUp | None:
        warm = self.warmups.get(warm_id)
        if warm is None or warm.outcome is not None or warm.piece_upto is None:
            return None
        warm.restorable, warm.piece_upto = 0, None
        return warm

    def on_piece_failed(self, warm_id: str, reason: str, now: float) -> list[WarmDecision]:
        warm = self.warmups.get(warm_id)
        if warm is None or warm.outcome is not None:
            return []
        warm.piece_upto = None
        if warm.ending is not None:  # it was ending anyway: say how, and why the piece failed
            outcome, why = warm.ending
            return self._end(warm, outcome, f"{why}; its last piece failed: {reason}", now)
        return self._end(warm, Outcome.FAILED, f"piece failed: {reason}", now)

    def cancel(self, warm_id: str, now: float, why: str = "cancelled by its client") -> list[WarmDecision]:
        """Rule 9; KeyError for an id the queue does not know (any more)."""
        warm = self.warmups[warm_id]
        if warm.outcome is not None:
            return []
        cancel: list[WarmDecision] = [CancelWarmPiece(warm_id)] if warm.piece_upto is not None else []
        warm.piece_upto = None
        return [*cancel, *self._end(warm, Outcome.CANCELLED, why, now)]

    def claim(self, ids: Sequence[int], now: float) -> tuple[list[WarmDecision], list[str]]:
        """Rule 7, first half: a real request with prompt `ids` arrived. Returns the decisions and
        the warm-ups whose piece in flight the request must wait for."""
        out: list[WarmDecision] = []
        wait: list[str] = []
        for warm in self.active():
            if self._same(warm, ids):
                why = "a request of the same conversation arrived"
                if warm.piece_upto is not None:
                    warm.ending = (Outcome.SUPERSEDED, why)
                    wait.append(warm.id)
                else:
                    out += self._end(warm, Outcome.SUPERSEDED, why, now)
        return out, wait

    def credit(self, ids: Sequence[int]) -> Credit:
        """Rule 7, second half: the tokens of `ids` that ended warm-ups of its conversation
        computed; each warm-up is credited once."""
        tokens, credited, largest = 0, [], 0
        for warm in self.warmups.values():
            if warm.outcome is None or warm.credited or warm.computed == 0:
                continue
            common = common_prefix(warm.ids, ids)
            if same_conversation(common, len(warm.ids)):
                warm.credited = True
                credited.append(warm.id)
                tokens += min(warm.computed, max(0, min(common, warm.done_upto) - warm.cached))
                largest = max(largest, warm.largest_piece or 0)
        return Credit(tokens, tuple(credited), largest)

    # ---- queries -----------------------------------------------------------------------------------

    def active(self) -> list[WarmUp]:
        """Pending and running warm-ups, in the order they were asked for."""
        return [w for w in self.warmups.values() if w.outcome is None]

    def claimable(self) -> bool:
        """Whether a real request could end or be credited with a warm-up (else it need not be
        tokenized for it)."""
        return any(w.outcome is None or (w.computed and not w.credited) for w in self.warmups.values())

    def next_wakeup(self, load: Load, knobs: WarmKnobs, now: float) -> float | None:
        """The earliest time after `now` at which `on_tick` may decide something with no event."""
        times = [w.submitted + knobs.expire_s for w in self.active()]
        warm = self._next()
        if warm is not None and warm.piece_upto is None and load.busy:
            times.append(warm.next_piece_at)
        if load.recheck_at is not None:
            times.append(load.recheck_at)
        later = [t for t in times if t > now]
        return min(later) if later else None

    def __iter__(self) -> Iterator[WarmUp]:
        return iter(list(self.warmups.values()))

    # ---- internals ---------------------------------------------------------------------------------

    def _next(self) -> WarmUp | None:
        """Rule 4: the running one, else the pending one with the fewest tokens to compute."""
        active = self.active()
        running = [w for w in active if w.started is not None]
        if running:
            return running[0]
        return min(active, key=lambda w: (w.to_compute, w.submitted), default=None)

    def _same(self, warm: WarmUp, ids: Sequence[int]) -> bool:
        return same_conversation(common_prefix(warm.ids, ids), len(warm.ids))

    def _check_bounds(self, warm: WarmUp, replaced: list[WarmUp], knobs: WarmKnobs) -> None:
        staying = [w for w in self.active()
                   if w.ending is None and all(w is not r for r in replaced)]
        if len(staying) >= knobs.max_pending:
            raise _full(len(staying), knobs)
        mine = [w for w in staying if warm.client is not None and w.client == warm.client]
        if len(mine) >= knobs.max_per_client:
            raise WarmRefused(f"client {warm.client!r} has {len(mine)} warm-ups pending or running "
                              f"already (warm.max_per_client = {knobs.max_per_client})")

    def _stop(self, warm: WarmUp, outcome: Outcome, why: str, now: float) -> list[WarmDecision]:
        """End now, or once the piece in flight is done."""
        if warm.piece_upto is not None:
            warm.ending = (outcome, why)
            return []
        return self._end(warm, outcome, why, now)

    def _expire(self, knobs: WarmKnobs, now: float) -> list[WarmDecision]:
        out: list[WarmDecision] = []
        for warm in self.active():
            if now >= warm.submitted + knobs.expire_s and warm.ending is None:
                out += self._stop(warm, Outcome.EXPIRED,
                                  f"not finished within warm.expire_s = {knobs.expire_s:g} s", now)
        self._forget(knobs, now)
        return out

    def _end(self, warm: WarmUp, outcome: Outcome, why: str, now: float) -> list[WarmDecision]:
        warm.outcome, warm.reason, warm.ended, warm.ending = outcome, why, now, None
        return [Ended(warm.id)]

    def _forget(self, knobs: WarmKnobs, now: float) -> None:
        ended = sorted(((w.ended, w.id) for w in self.warmups.values() if w.ended is not None),
                       reverse=True)
        old = {warm_id for at, warm_id in ended if now - at >= knobs.expire_s}
        old.update(warm_id for _, warm_id in ended[KEEP_ENDED:])
        for warm_id in old:
            del self.warmups[warm_id]


def _full(staying: int, knobs: WarmKnobs) -> WarmRefused:
    return WarmRefused(f"{staying} warm-ups are pending or running already "
                       f"(warm.max_pending = {knobs.max_pending}); try again later")
