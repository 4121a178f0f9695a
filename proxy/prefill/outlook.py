"""What each way on for a cold prompt is predicted to give, from the fitted batch cost: the pieces'
compute and pauses, the streams' share, the cold request's time against alone, and the trade of
both. Pure arithmetic; `strategy.py` chooses among the outlooks.

The outlook of an option, from now until the cold request's first token. t(n, x) is the predicted
batch of n tokens after a prefix of x (d streams decoding beside it); the rest is R tokens after the
prefix D; s = `prefill_share`; δ = the streams' decode step alone (0 when unknown: then what they get
inside a batch, one token per batch, is not counted).

  Pieces of n: k = ceil(R/n) batches, the last one being the real request (no pause after it).
    compute  C(n) = Σ t = k·(a + e·d) + b·R + c·R·(D + R/2)/1000     attention does not depend on n
    pauses   P(n) = (C(n) - t_last)·(1 - s)/s                       the pause rule after every piece
    streams  S(n) = (P(n) + k·δ) / (C(n) + P(n))                    full speed in pauses, 1 token per batch
    cold     F(n) = (C(n) + P(n)) / C_off                            C_off = the rest in n_batch batches
    trade    Q(n) = S(n) + 1/F(n)                                    what both keep (the issue's measure)
  Off (the whole rest now): S = k_off·δ/C_off, F = 1, so Q_off = 1 + S ≈ 1.
  Hold for H ≤ (HOLD_COLD_FACTOR - CATCH_UP)·C_off, then catch-up pieces taking up to CATCH_UP·C_off
    (their extra counted as the streams' time): W = H + (CATCH_UP - 1)·C_off, S = (W + k_off·δ)/(W + C_off),
    F = (W + C_off)/C_off, Q = 1 + k_off·δ/(W + C_off): the worst case (the streams generate
    throughout); if they finish sooner, the cold request goes at once and everyone gains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.sizing import PIECE_ALIGN

RAMP = 2
"""Rule 1: a piece is at most this × the largest piece already measured for the request, so a model
fitted on small pieces at a short prefix errs by at most one moderately longer batch."""
HOLD_COLD_FACTOR = 3.0
"""Rule 6: a hold ends early enough for the cold request to take at most this × its time alone,
catch-up pieces after it included (the issue's aim for the cold request on a busy machine)."""
BEHIND_SHARE = 0.8
"""Rule 6: the most of the time pieces take while others generate, also for a cold request behind
`max_cold_factor` or catching up: after a piece the streams get at least a quarter of its time, so
their longest gap stays about one piece (with no pause at all it became several pieces long)."""
CATCH_UP = 1.5
"""Rule 8: catch-up pieces, their pauses included, take at most this × the rest sent whole. Sent
whole, a rest of 1,000-2,000 tokens beside four streams on one shared KV took 4-8 s on this CPU,
every stream frozen for all of it (`bench day`, 41edf33: the day's longest gaps); in 512-token pieces
a stream waits one piece (~1.5-2 s) at a time."""


@dataclass(frozen=True)
class Situation:
    """Where the cold request stands."""

    done_tokens: int
    """Prompt tokens its slot holds already (cached at arrival, then fed)."""
    remaining_tokens: int
    decoders: int
    """Other requests generating."""
    cells: int = 0
    """Cells the other requests in flight hold (their prompts): one shared KV's cost."""
    decode_step_ms: float | None = None
    """Their decode step alone (None: not known, nothing counted inside a batch)."""
    largest_piece: int | None = None
    """The largest piece already sent and done for this request (None: none yet)."""
    probe: bool = False
    """The fitted cost has seen batches of one size only (`BatchCostModel.needs_probe`)."""

    def piece_cap(self, n_batch: int) -> int:
        """Rule 1's ramp: RAMP × the largest piece sent (`n_batch` before the first: the first
        is sized by the model as it stands, which is the conservative prior on a new server), and
        never under PIECE_ALIGN: pieces end on its multiples, and under it one that starts off them
        would end one token on (bench day: 265 one-token pieces of a turn whose first piece
        computed few, 104 s to its first token)."""
        return ramp_cap(n_batch, self.largest_piece)


def ramp_cap(n_batch: int, largest_piece: int | None) -> int:
    """`Situation.piece_cap` for a request whose largest piece sent is `largest_piece`."""
    if not largest_piece:
        return n_batch
    return min(n_batch, max(PIECE_ALIGN, RAMP * largest_piece))


@dataclass(frozen=True)
class ChunkKnobs:
    max_stall_ms: float
    n_batch: int
    prefill_share: float
    max_hold_ms: float
    """The longest hold (`prefill.max_hold_s` × 1000); 0: never hold."""


@dataclass(frozen=True)
class Outlook:
    """What an option is predicted to give, from now until the cold request's first token."""

    compute_ms: float
    wait_ms: float
    """Pauses between pieces, or the hold."""
    longest_batch_ms: float
    """The streams' longest gap."""
    streams_share: float
    cold_factor: float

    @property
    def trade(self) -> float:
        return self.streams_share + 1.0 / self.cold_factor


def piece_sizes(n_batch: int) -> list[int]:
    """Multiples of 64 from 64 up to `n_batch` (just 64 when `n_batch` is smaller)."""
    return list(range(PIECE_ALIGN, max(PIECE_ALIGN, n_batch // PIECE_ALIGN * PIECE_ALIGN) + 1, PIECE_ALIGN))


def fitting_piece(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> int:
    """The largest size whose batch at the current prefix is predicted within `max_stall_ms` (64 if none)."""
    fits = [n for n in piece_sizes(sit.piece_cap(knobs.n_batch))
            if cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells) <= knobs.max_stall_ms]
    return max(fits, default=PIECE_ALIGN)


def pieces_outlook(cost: BatchCost, n: int, sit: Situation, knobs: ChunkKnobs, *,
                   pauses: bool = True) -> Outlook:
    """The rest in pieces of `n` with the pause rule between them (`pauses=False`: back to back)."""
    rest, done, d, m = sit.remaining_tokens, sit.done_tokens, sit.decoders, sit.cells
    k = max(1, math.ceil(rest / n))
    compute = cost.prompt_ms(rest, done, n, d, m)
    t_last = cost.batch_ms(rest - (k - 1) * n, done + (k - 1) * n, d, m)
    t_full = cost.batch_ms(n, done + (k - 2) * n, d, m) if k >= 2 else 0.0
    share = knobs.prefill_share
    wait = (compute - t_last) * (1.0 - share) / share if pauses else 0.0
    return _outlook(cost, compute, wait, max(t_last, t_full), k, sit, knobs)


def off_outlook(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> Outlook:
    return pieces_outlook(cost, max(1, knobs.n_batch), sit, knobs, pauses=False)


def hold_outlook(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> Outlook:
    """Held (at most `max_hold_ms`, and at most HOLD_COLD_FACTOR × its time alone in all), the streams
    generating throughout, then the rest in catch-up pieces (at most CATCH_UP × its time whole)."""
    off = off_outlook(cost, sit, knobs)
    k_off = max(1, math.ceil(sit.remaining_tokens / max(1, knobs.n_batch)))
    hold = longest_hold_ms(off, knobs)
    return _outlook(cost, off.compute_ms, hold + (CATCH_UP - 1.0) * off.compute_ms,
                    off.longest_batch_ms, k_off, sit, knobs)


def longest_hold_ms(off: Outlook, knobs: ChunkKnobs) -> float:
    """How long a hold may last: `max_hold_ms`, and HOLD_COLD_FACTOR × the time alone with the
    catch-up after it."""
    return min(knobs.max_hold_ms, (HOLD_COLD_FACTOR - CATCH_UP) * off.compute_ms)


def _outlook(cost: BatchCost, compute: float, wait: float, longest: float, batches: int,
             sit: Situation, knobs: ChunkKnobs) -> Outlook:
    alone = max(cost.prompt_ms(sit.remaining_tokens, sit.done_tokens, knobs.n_batch, sit.decoders,
                               sit.cells), 1e-9)
    window = max(compute + wait, 1e-9)
    inside = batches * (sit.decode_step_ms or 0.0)
    return Outlook(compute_ms=compute, wait_ms=wait, longest_batch_ms=longest,
                   streams_share=min(1.0, (wait + inside) / window), cold_factor=window / alone)
