"""The what-if's one seam to slotwise's prefill policy: the real `PrefillPolicy`, told what happens
in the model through its public `on_*` methods, exactly as the prefill gate (`proxy/prefill/gate.py`)
tells it, with the model's clock as `now`; its decisions turned into the replay's few actions.

Kept to this one small module so that changes to the policy are followed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import PrefillConfig
from proxy.prefill.events import Admit, CancelPiece, Decision, FeedPiece, Forward, Hold, Reject
from proxy.prefill.policy import PrefillPolicy
from proxy.record.flight import Phase


@dataclass(frozen=True)
class Send:
    """Send the request upstream now; `pieces_fed`: after pieces (the gate's Forward)."""

    req_id: str
    reason: str
    pieces_fed: bool = False


Action = Send | Hold | FeedPiece | Reject | CancelPiece
"""What the replay applies: the policy's own decisions, Admit and Forward made one `Send`."""


class PolicySeam:
    """Mode `off` admits every request at once (the policy's rule 2) and decides nothing else, so
    there the seam answers itself: the fits the policy would make of every finished prefill (most
    of a replay's time) change no decision."""

    def __init__(self, config: PrefillConfig, n_batch: int, slots: int) -> None:
        self.mode = config.mode
        self._policy = PrefillPolicy(config, n_batch=n_batch) if config.mode != "off" else None
        if self._policy is not None:  # as the gate does, from /props
            self._policy.set_slots(slots)
        self.unknown: dict[str, int] = {}
        """Decisions of a kind this seam does not know, by name (left unapplied)."""

    def arrived(self, key: str, est_new: int, est_prompt: int, now: float) -> list[Action]:
        if self._policy is None:
            return [Send(key, "prefill.mode off")]
        return self._actions(self._policy.on_arrival(key, est_new, est_prompt, now))

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

    def client_left(self, key: str, now: float) -> list[Action]:
        if self._policy is None:
            return []
        return self._actions(self._policy.on_client_left(key, now))

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
            if isinstance(decision, Admit):
                out.append(Send(decision.req_id, decision.reason))
            elif isinstance(decision, Forward):
                out.append(Send(decision.req_id, decision.reason, pieces_fed=True))
            elif isinstance(decision, Hold | FeedPiece | Reject | CancelPiece):
                out.append(decision)
            else:
                name = type(decision).__name__
                self.unknown[name] = self.unknown.get(name, 0) + 1
        return out
