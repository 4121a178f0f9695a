"""The what-if's one seam to slotwise's prefill policy: the real `PrefillPolicy`, told what happens
in the model through its public `on_*` methods, exactly as the prefill gate (`proxy/prefill/gate.py`)
tells it, with the model's clock as `now`; its decisions turned into the replay's few actions.

Kept to this one small module so that changes to the policy are followed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import PrefillConfig
from proxy.prefill.deciding import MODE_OFF
from proxy.prefill.events import (
    Admit,
    CancelPiece,
    Decision,
    FeedPiece,
    Forward,
    Hold,
    Load,
    Reject,
    Restorable,
    Restore,
    Save,
    Sizer,
)
from proxy.prefill.learned import Learned
from proxy.prefill.narrow import MIN_SAMPLES
from proxy.prefill.policy import PrefillPolicy
from proxy.record.flight import Phase


@dataclass(frozen=True)
class Send:
    """Send the request upstream now (the gate's Admit, or its Forward after pieces)."""

    req_id: str
    reason: str


Action = Send | Hold | FeedPiece | Reject | CancelPiece | Restore | Save
"""What the replay applies: the policy's own decisions, Admit and Forward made one `Send`."""


class PolicySeam:
    """Mode `off` without kept KV or warm-ups admits every request at once (the policy's rule 2)
    and decides nothing else, so there the seam answers itself: the fits the policy would make of
    every finished prefill (most of a replay's time) change no decision. With kept KV (`keep`) the
    policy decides restores and saves in every mode (its rules 14 and 16), and with warm-ups
    (`warm`) it gives their queue its load and piece sizes (rule 15), as in the gate."""

    def __init__(self, config: PrefillConfig, n_batch: int, slots: int, *,
                 shared_kv: bool = True, keep: bool = False, warm: bool = False) -> None:
        self.estimates = config.mode != "off" or keep or warm
        self._config = config
        """Arrivals come with their estimate (and a kept file), as the gate's do."""
        self._policy = PrefillPolicy(config, n_batch=n_batch) if self.estimates else None
        if self._policy is not None:  # as the gate does, from /props
            self._policy.set_layout(slots, shared_kv)
        self.unknown: dict[str, int] = {}
        """Decisions of a kind this seam does not know, by name (left unapplied)."""

    def start_learned(self, narrow_per_row_kctx_ms: float) -> None:
        """A slotwise with `prefill.learned_file` that ran on this server before starts the day
        knowing its row-by-row price (rule 19): as if it had seen MIN_SAMPLES short batches at the
        price the calibration found, when the file itself is not at hand (`adopt` when it is).
        (Its batch cost starts at the prior: a seed from the model's costs, tried on four `bench
        day` logs, moved the streams' rate in the day's first seconds both ways.)"""
        if self._policy is not None and narrow_per_row_kctx_ms > 0:
            self._policy.adopt_learned([], [narrow_per_row_kctx_ms] * MIN_SAMPLES)

    def adopt(self, learned: Learned) -> None:
        """The day starts from what the learned file holds, as slotwise's start does."""
        if self._policy is not None:
            self._policy.adopt_learned(learned.batches, learned.narrow)

    def arrived(self, key: str, est_new: int, est_prompt: int, now: float,
                restorable: Restorable | None = None, purpose: str | None = None,
                guessed: int = 0, ramp_from: int = 0) -> list[Action]:
        """`guessed`: of its cached tokens, a held reply's not known to be found (rule 19);
        `ramp_from`: its warm-ups' largest piece (rule 15)."""
        if self._policy is None:
            return [Send(key, MODE_OFF)]
        return self._actions(self._policy.on_arrival(
            key, est_new, est_prompt, now, restorable,
            background=self._config.is_background(purpose), guessed_tokens=guessed,
            ramp_from=ramp_from))

    def restored(self, key: str, est_new: int, now: float) -> list[Action]:
        return [] if self._policy is None else self._actions(
            self._policy.on_restored(key, est_new, now))

    def restore_failed(self, key: str, reason: str, now: float, *, no_slot: bool) -> list[Action]:
        return [] if self._policy is None else self._actions(
            self._policy.on_restore_failed(key, reason, now, no_slot=no_slot))

    def save_due(self, save_id: str, now: float) -> list[Action]:
        """A save the log shows is due; it goes when the policy lets it (rule 16: a quiet server)."""
        return [] if self._policy is None else self._actions(self._policy.on_save_due(save_id, now))

    def save_done(self, save_id: str, ms: float, now: float) -> list[Action]:
        return [] if self._policy is None else self._actions(
            self._policy.on_save_done(save_id, ms, now))

    def phase(self, key: str, phase: Phase, now: float, *, prompt_n: int | None = None,
              prompt_ms: float | None = None, cache_n: int = 0) -> list[Action]:
        """The registry's phase changes, as `PrefillGate.on_phase` passes them on."""
        if self._policy is None:
            return []
        if phase is Phase.PREFILLING:
            return self._actions(self._policy.on_prefill_started(key, now))
        if phase is Phase.DECODING:
            return self._actions(self._policy.on_first_token(key, now))
        if phase is Phase.DONE:
            return self._actions(self._policy.on_finished(key, now, prompt_n, prompt_ms,
                                                          cache_n=cache_n))
        return []

    def piece_done(self, key: str, tokens: int, batch_ms: float, now: float) -> list[Action]:
        if self._policy is None:
            return []
        return self._actions(self._policy.on_piece_done(key, tokens, batch_ms, now))

    def warm_load(self, now: float) -> Load:
        """Rule 15: what real requests are doing, for the warm-up queue (with `warm` only)."""
        assert self._policy is not None, "warm-ups are ticked only with a policy (warm=True)"
        return self._policy.warm_load(now)

    def warm_sizer(self) -> Sizer:
        assert self._policy is not None, "warm-ups are ticked only with a policy (warm=True)"
        return self._policy.warm_sizer()

    def warm_pieces(self, in_flight: int, now: float) -> list[Action]:
        """How many warm-up pieces are in flight now (a slot user each, and the piece in flight)."""
        return [] if self._policy is None else self._actions(
            self._policy.on_warm_pieces(in_flight, now))

    def warm_piece_done(self, prompt_n: int, cache_n: int, batch_ms: float) -> None:
        """A warm-up's piece teaches the batch cost (rules 9, 15)."""
        if self._policy is not None:
            self._policy.on_warm_piece_done(prompt_n, cache_n, batch_ms)

    def client_left(self, key: str, now: float) -> list[Action]:
        if self._policy is None:
            return []
        return self._actions(self._policy.on_client_left(key, now))

    def slot_wait_ms(self, key: str) -> float:
        """How long the policy held the request for a slot (the record's `slot_wait_ms`)."""
        return 0.0 if self._policy is None else round(self._policy.slot_wait_s(key) * 1000.0, 1)

    def tick(self, now: float) -> list[Action]:
        return [] if self._policy is None else self._actions(self._policy.on_tick(now))

    def next_wakeup(self) -> float | None:
        return None if self._policy is None else self._policy.next_wakeup()

    def cost_summary(self) -> str | None:
        """The batch cost the policy has learned by now (None in mode off)."""
        return None if self._policy is None else self._policy.snapshot().cost.summary()

    def _actions(self, decisions: list[Decision]) -> list[Action]:
        out: list[Action] = []
        for decision in decisions:
            if isinstance(decision, Admit | Forward):
                out.append(Send(decision.req_id, decision.reason))
            elif isinstance(decision, Hold | FeedPiece | Reject | CancelPiece | Restore | Save):
                out.append(decision)
            else:
                name = type(decision).__name__
                self.unknown[name] = self.unknown.get(name, 0) + 1
        return out
