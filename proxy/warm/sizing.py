"""How large a warm-up's next piece is: chunk's fitting piece (`strategy.fitting_piece`) from the
prefill policy's fitted batch cost, with the stall it may cause chosen by what the server is doing.
Pure: the cost and the knobs in, a size out.

While others generate a piece may stall them as long as one of `chunk`'s pieces (`max_stall_ms`):
the streams keep what `chunk` leaves them. On an idle server nobody is stalled, only a real request
that arrives during a piece waits for the rest of its batch; pieces of IDLE_STALL × `max_stall_ms`
keep that wait at about one piece while using the server better than small ones (fewer fixed parts).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.outlook import ChunkKnobs, Situation, fitting_piece
from proxy.prefill.pacing import IDLE_STALL
from proxy.warm.values import Load


@dataclass(frozen=True)
class CostSizer:
    """A `Sizer` over one reading of the batch cost and the `[prefill]` knobs in force."""

    cost: BatchCost
    max_stall_ms: float
    n_batch: int
    prefill_share: float

    def limit_ms(self, load: Load) -> float:
        return self.max_stall_ms * (1.0 if load.busy else IDLE_STALL)

    def piece(self, done: int, remaining: int, largest: int | None, load: Load) -> int:
        situation = Situation(done_tokens=done, remaining_tokens=remaining, decoders=load.decoders,
                              largest_piece=largest)
        knobs = ChunkKnobs(max_stall_ms=self.limit_ms(load), n_batch=self.n_batch,
                           prefill_share=self.prefill_share, max_hold_ms=0.0)
        return fitting_piece(self.cost, situation, knobs)
