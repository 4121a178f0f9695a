"""The plan for the one cold request the policy is holding or feeding: how far its pieces got, and
how its release is worded. Pure data with a little arithmetic; the policy decides."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.prefill.events import Admit, Arrived, Forward
from proxy.prefill.snapshot import ChunkProgress


@dataclass
class Plan:
    req: Arrived
    done_upto: int
    """Prompt tokens the server holds already (cached at arrival, then fed)."""
    deadline: float
    """`defer`: when the hold ends at the latest."""
    piece_upto: int | None = None
    """The prefix a piece in flight computes; None between pieces."""
    next_piece_at: float = 0.0
    pieces_done: int = 0

    @classmethod
    def for_request(cls, req: Arrived, max_hold_s: float) -> Plan:
        cached = max(0, req.est_prompt_tokens - req.est_new_tokens)
        return cls(req=req, done_upto=cached, deadline=req.now + max_hold_s)

    def release(self, why: str) -> Admit | Forward:
        """Admit if no piece was fed, else Forward; the reason says how far the feeding got."""
        if self.pieces_done == 0:
            return Admit(self.req.req_id, f"cold, {why}")
        return Forward(self.req.req_id,
                       f"{why} after {self.pieces_done} pieces ({self.done_upto} tokens fed)")

    def progress(self) -> ChunkProgress:
        return ChunkProgress(
            req_id=self.req.req_id, done_tokens=self.done_upto,
            total_tokens=self.req.est_prompt_tokens, pieces_done=self.pieces_done,
            piece_in_flight_upto=self.piece_upto,
            next_piece_at=self.next_piece_at if self.piece_upto is None else None)
