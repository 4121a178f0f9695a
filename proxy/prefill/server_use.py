"""Who uses llama-server now, as the prefill policy counts it: the requests sent upstream and not
finished, each one's phase and when it was sent. Pure; the policy adds the pieces and restores it
has in flight when it counts free slots (rule 12).
"""

from __future__ import annotations

from proxy.record.flight import Phase

SENT_GRACE_S = 0.5
"""Rule 8: a request just sent upstream is about to start its prompt (a stream shows its prefill
only once it starts); the next piece waits for it this long at most, since a non-streamed request
shows nothing until it ends."""


class ServerUse:
    def __init__(self) -> None:
        self.phases: dict[str, Phase] = {}
        self._sent_at: dict[str, float] = {}
        self._cells: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.phases)

    def __bool__(self) -> bool:
        return bool(self.phases)

    def sent(self, req_id: str, now: float, cells: int = 0) -> None:
        """`cells`: its prompt's tokens, the cells it will hold in the server's KV."""
        self.phases[req_id] = Phase.QUEUED
        self._sent_at[req_id] = now
        self._cells[req_id] = max(0, cells)

    def moved(self, req_id: str, phase: Phase) -> None:
        if req_id in self.phases:
            self.phases[req_id] = phase

    def ended(self, req_id: str) -> bool:
        """It finished or its client left; whether it was in flight."""
        self._sent_at.pop(req_id, None)
        self._cells.pop(req_id, None)
        return self.phases.pop(req_id, None) is not None

    def decoders(self, besides: str | None = None) -> int:
        """Requests decoding now (their tokens share every batch)."""
        return sum(1 for r, phase in self.phases.items() if phase is Phase.DECODING and r != besides)

    def streams(self) -> int:
        """Requests that generate beside the next batch: decoding now, or sent and not yet
        decoding (each generates once its own prompt is in, and a batch sent meanwhile stalls it
        as it stalls a decoder). `bench day`: a 645-token translation that arrived while a chat
        turn computed its 52 tokens was judged beside nobody generating, went whole, and froze
        that turn's stream 1.2-1.7 s, in each of three runs."""
        return sum(1 for phase in self.phases.values()
                   if phase in (Phase.QUEUED, Phase.PREFILLING, Phase.DECODING))

    def cells(self, besides: str | None = None) -> int:
        """Cells the requests in flight hold (their prompts; what they generated is not known
        here): on one shared KV every batch pays for them (batch_cost.py)."""
        return sum(c for r, c in self._cells.items() if r != besides)

    def prefilling(self) -> bool:
        return any(phase is Phase.PREFILLING for phase in self.phases.values())

    def sent_grace_end(self) -> float:
        """When the last request sent but not yet prefilling stops holding the next piece."""
        return max((self._sent_at[r] + SENT_GRACE_S for r, phase in self.phases.items()
                    if phase is Phase.QUEUED), default=0.0)
