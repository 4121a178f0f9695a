"""What the prefill policy knows: the knobs, the fitted batch cost and every user of the server's
slots (requests sent, cold plans, the slot line, warm-up pieces, a save, trim pieces); and what it
reads from that: the plans' `Server`, the warm-ups' `Load`, its snapshot. Pure; the policy owns the
one instance, which its events, deciding.py and learning.py change.
"""

from __future__ import annotations

from proxy.config import PrefillConfig
from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.events import Load, Sizer
from proxy.prefill.pacing import WarmSizer
from proxy.prefill.plans import ColdPlans, Server
from proxy.prefill.server_use import ServerUse
from proxy.prefill.slot_line import SlotLine
from proxy.prefill.snapshot import PolicySnapshot
from proxy.prefill.trims import Trims


class PolicyState:
    def __init__(self, config: PrefillConfig, n_batch: int, cost: BatchCostModel,
                 slots: int | None) -> None:
        self.cfg = config
        self.n_batch = n_batch
        self.cost = cost
        self.use = ServerUse()
        self.plans = ColdPlans()  # rules 4-8 (plans.py)
        self.line = SlotLine(slots)  # rules 12 and 14 (slot_line.py)
        self.notes: dict[str, str] = {}  # what happened before a request's release (rule 14)
        self.warm_pieces = 0
        """Warm-up pieces in flight (rule 15)."""
        self.saving: str | None = None
        """The save in flight, if any (rule 16)."""
        self.shared_kv: bool | None = None
        """One KV pool shared by the slots (`set_layout`; None: not known)."""
        self.trims = Trims()  # rule 19 (trims.py)
        self.now = 0.0
        """The latest `now` the policy decided at (`server`'s view of the slot line)."""

    def noted(self, req_id: str, reason: str) -> str:
        """`reason`, after what happened to the request before (its note, which this takes)."""
        note = self.notes.pop(req_id, None)
        return reason if note is None else f"{note}; {reason}"

    # ---- counting ----------------------------------------------------------------------------

    def taken(self) -> int:
        """Rule 12: the slots used or kept besides the restores running (the line counts those)."""
        return (len(self.use) + self.warm_pieces + (self.saving is not None)
                + self.plans.slots_kept() + len(self.trims))

    def slots_scarce(self) -> bool:
        """Rule 1: somebody waits for a slot, or one more slot used would leave none free: a
        background job is then judged as a chat turn (its pieces keep a slot for seconds: on
        `bench day`'s four slots for six clients, translations fed in pieces made the chat turns'
        slot waits grow, their p90 from 10.4-10.8 to 13.2-14.4 s)."""
        return bool(self.line) or (self.line.slots is not None
                                   and self.line.free(self.taken()) <= 1)

    def server(self) -> Server:
        """The plans' view, at the last `now` the policy was given (`deciding.advance`)."""
        now = self.now
        return Server(self.cfg, self.n_batch, self.cost, self.use,
                      other_piece=bool(self.warm_pieces or self.saving or self.trims),
                      free_slots=(None if self.line.slots is None
                                  else self.line.free(self.taken())),
                      slot_wanted=bool(self.line),
                      first_held=self.line.first_place(now, self.cfg.max_hold_s), now=now)

    # ---- what it shows -------------------------------------------------------------------------

    def next_wakeup(self) -> float | None:
        times = [t for t in (self.line.next_wakeup(), self.plans.next_wakeup(self.server()))
                 if t is not None]
        return min(times, default=None)

    def save_ok(self) -> bool:
        """Nobody else uses the server: nothing sent, held, fed, restored, warmed or saved."""
        return not (self.use or self.plans or self.line or self.warm_pieces or self.saving
                    or self.trims)

    def warm_load(self, now: float) -> Load:
        """A save in flight pauses the warm-ups like a request just sent."""
        grace = self.use.sent_grace_end()
        return Load(cold_held=bool(self.plans or self.line),
                    starting=now < grace or self.saving is not None or bool(self.trims),
                    busy=bool(self.use) or self.saving is not None,
                    no_slot=self.line.full(self.taken()),
                    decoders=self.use.decoders(), cells=self.use.cells(),
                    recheck_at=grace if now < grace else None)

    def warm_sizer(self) -> Sizer:
        cfg = self.cfg
        return WarmSizer(self.cost.cost, cfg.max_stall_ms, self.n_batch, cfg.prefill_share)

    def snapshot(self) -> PolicySnapshot:
        active = self.plans.active()
        waiting = tuple(r for r in self.plans if active is None or r != active.req.req_id)
        others = self.line.held()
        return PolicySnapshot(
            mode=self.cfg.mode,
            held=((active.req.req_id,) if active else ()) + waiting + others,
            waiting=waiting,
            chunking=(active.progress(self.plans.next_piece_at) if active and self.cfg.mode == "chunk"
                      else None),
            in_flight=tuple(self.use.phases.items()),
            cost=self.cost.describe(),
            choice=active.choice if active else None,
        )
