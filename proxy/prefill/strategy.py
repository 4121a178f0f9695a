"""How a cold prompt goes on from here: pieces that fit `max_stall_ms`, larger pieces, a bounded hold,
or the whole rest at once. Chosen from the batch-cost model (`batch_cost.py`) by what the streams and
the cold request each keep. Pure: numbers in, a `PieceChoice` out; the policy applies it.

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
  Hold for H ≤ (HOLD_COLD_FACTOR - 1)·C_off: S = (H + k_off·δ)/(H + C_off), F = (H + C_off)/C_off,
    Q = 1 + k_off·δ/(H + C_off): the worst case (the streams generate throughout); if they finish
    sooner, the cold request goes at once and everyone gains.

With δ = 0: Q(n) = 1 - (C(n) - C_off)/(C(n) + P(n)). Chunking loses exactly the extra compute of its
smaller batches, (k - k_off) fixed parts: tiny pieces on a machine whose fixed part is 1.5 s lose
nearly everything, while pieces of n_batch reach off's trade. And Q ≥ Q_off - ε ⟺ F·(1 - S) ≤ 1 + ε·F:
the streams' stalled time, in units of the cold prompt alone, is at most what off stalls them plus
ε·F, the price of never freezing them. ε = TRADE_SLACK = 0.25: the predicted trade of ordinary
pieces sits within a few hundredths of 0.9 (measured 0.94 on the recommended set-up), and a model
fitted from a few pieces errs by about that much, so a tighter floor would turn good pieces into
long ones on a model's whim; the disasters it guards against (tiny pieces on a busy machine) trade
0.1-0.5. A hold reaches off's trade too, and so do pieces of n_batch, so the trade alone cannot
choose between larger pieces and a hold: pieces win when they stall the streams no longer than off
(rule 5), since they also bound what the cold request pays; otherwise the hold does (rule 6).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.sizing import PIECE_ALIGN

STALL_SLACK = 2.0
"""Rule 4: pieces keep their promise while the next one is predicted within this × `max_stall_ms`
(the issue allows the streams' longest gap up to 2 × `max_stall_ms`)."""
TRADE_SLACK = 0.25
"""Rule 3: an option whose trade is below off's minus this is never chosen."""
TARGET_TRADE = 0.9
"""Rule 4: what fitting pieces should keep (the streams' share + the cold request's share); issue #8's aim."""
STRETCH = 1.5
"""Rule 4: how far past `max_stall_ms` a piece may grow to reach TARGET_TRADE."""
RAMP = 2
"""Rule 1: a piece is at most this × the largest piece already measured for the request, so a model
fitted on small pieces at a short prefix errs by at most one moderately longer batch."""
HOLD_COLD_FACTOR = 3.0
"""Rule 6: a hold ends by the time the cold request would have taken this × its time alone (the issue's
aim for the cold request on a busy machine)."""
TRADE_KNEE = 0.05
"""Rule 5: a larger piece is worth its longer batch only while it gains more than this in trade."""


class Strategy(enum.Enum):
    PIECES = "pieces"
    LARGER_PIECES = "larger_pieces"
    HOLD = "hold"
    WHOLE = "whole"


@dataclass(frozen=True)
class Situation:
    """Where the cold request stands."""

    done_tokens: int
    """Prompt tokens its slot holds already (cached at arrival, then fed)."""
    remaining_tokens: int
    decoders: int
    """Other requests generating."""
    decode_step_ms: float | None = None
    """Their decode step alone (None: not known, nothing counted inside a batch)."""
    largest_piece: int | None = None
    """The largest piece already measured for this request (None: none yet)."""

    def piece_cap(self, n_batch: int) -> int:
        """Rule 1's ramp: RAMP × the largest piece measured (`n_batch` before the first: the first
        is sized by the model as it stands, which is the conservative prior on a new server)."""
        return min(n_batch, RAMP * self.largest_piece) if self.largest_piece else n_batch


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


@dataclass(frozen=True)
class PieceChoice:
    strategy: Strategy
    piece_tokens: int
    """The next piece (0 for HOLD and WHOLE)."""
    predicted_piece_ms: float
    """The next piece's batch; for HOLD and WHOLE, off's longest batch."""
    predicted_streams_share: float
    predicted_cold_factor: float
    predicted_trade: float
    off_trade: float
    hold_ms: float
    """HOLD: the longest hold; otherwise 0."""
    reason: str
    """One sentence for the record's `policy_note` and the status page."""


def piece_sizes(n_batch: int) -> list[int]:
    """Multiples of 64 from 64 up to `n_batch` (just 64 when `n_batch` is smaller)."""
    return list(range(PIECE_ALIGN, max(PIECE_ALIGN, n_batch // PIECE_ALIGN * PIECE_ALIGN) + 1, PIECE_ALIGN))


def fitting_piece(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> int:
    """The largest size whose batch at the current prefix is predicted within `max_stall_ms` (64 if none)."""
    fits = [n for n in piece_sizes(sit.piece_cap(knobs.n_batch))
            if cost.batch_ms(n, sit.done_tokens, sit.decoders) <= knobs.max_stall_ms]
    return max(fits, default=PIECE_ALIGN)


def pieces_outlook(cost: BatchCost, n: int, sit: Situation, knobs: ChunkKnobs, *,
                   pauses: bool = True) -> Outlook:
    """The rest in pieces of `n` with the pause rule between them (`pauses=False`: back to back)."""
    rest, done, d = sit.remaining_tokens, sit.done_tokens, sit.decoders
    k = max(1, math.ceil(rest / n))
    compute = cost.prompt_ms(rest, done, n, d)
    t_last = cost.batch_ms(rest - (k - 1) * n, done + (k - 1) * n, d)
    t_full = cost.batch_ms(n, done + (k - 2) * n, d) if k >= 2 else 0.0
    share = knobs.prefill_share
    wait = (compute - t_last) * (1.0 - share) / share if pauses else 0.0
    return _outlook(cost, compute, wait, max(t_last, t_full), k, sit, knobs)


def off_outlook(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> Outlook:
    return pieces_outlook(cost, max(1, knobs.n_batch), sit, knobs, pauses=False)


def hold_outlook(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> Outlook:
    """Held (at most `max_hold_ms`, and at most HOLD_COLD_FACTOR × its time alone in all), the streams
    generating throughout, then the whole rest."""
    off = off_outlook(cost, sit, knobs)
    k_off = max(1, math.ceil(sit.remaining_tokens / max(1, knobs.n_batch)))
    hold = min(knobs.max_hold_ms, (HOLD_COLD_FACTOR - 1.0) * off.compute_ms)
    return _outlook(cost, off.compute_ms, hold, off.longest_batch_ms, k_off, sit, knobs)


def _outlook(cost: BatchCost, compute: float, wait: float, longest: float, batches: int,
             sit: Situation, knobs: ChunkKnobs) -> Outlook:
    alone = max(cost.prompt_ms(sit.remaining_tokens, sit.done_tokens, knobs.n_batch, sit.decoders), 1e-9)
    window = max(compute + wait, 1e-9)
    inside = batches * (sit.decode_step_ms or 0.0)
    return Outlook(compute_ms=compute, wait_ms=wait, longest_batch_ms=longest,
                   streams_share=min(1.0, (wait + inside) / window), cold_factor=window / alone)


def choose_piece(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> PieceChoice:
    """The way on for a cold request that is being fed while others generate.

    Rules (tests/test_strategy.py follows them one to one):
     1. Piece sizes are multiples of 64 from 64 to `n_batch`. The fitting piece is the largest one
        whose batch at the current prefix is predicted within `max_stall_ms`; 64 if none is; and at
        most RAMP × the largest piece already measured for the request, so a model fitted on small
        pieces at a short prefix errs by at most one moderately longer batch.
     2. WHOLE when the rest is no larger than the fitting piece: one more piece would be all of it.
     3. Never worse than off for everyone: an option whose trade is below off's − TRADE_SLACK is
        never chosen (the module docstring derives why that bounds the streams' stalled time).
     4. PIECES of the fitting piece when rule 3 allows them and the piece is predicted within
        STALL_SLACK × `max_stall_ms`; but when their trade is below TARGET_TRADE, the smallest
        larger piece (within the ramp) that reaches it while predicted within STRETCH ×
        `max_stall_ms` (if none does, the fitting piece): a slightly longer batch that stops
        the fixed part from eating the cold request's time.
     5. Otherwise the pieces cannot keep their promise, and the trade decides. Bigger pieces amortise
        the fixed part: from the fitting piece up, take the smallest size that still cuts the rest in
        two or more, whose trade reaches TARGET_TRADE or is within TRADE_KNEE of the best size's
        (past it a bigger piece only lengthens the gaps), that rule 3 allows, and whose longest
        batch is no longer than off's (a piece that stalls the streams longer than off would is no
        help to them): LARGER_PIECES, or PIECES if it is the fitting piece itself.
     6. HOLD when no size qualifies, like `defer`: for at most `max_hold_ms`, and at most until the
        cold request has waited HOLD_COLD_FACTOR × its time alone. Its worst case (the streams
        generate throughout) is off's trade, and they keep their full speed while it lasts.
     7. WHOLE otherwise (`max_hold_ms` = 0).
    """
    _check(sit, knobs)
    fit = fitting_piece(cost, sit, knobs)
    off = off_outlook(cost, sit, knobs)
    if sit.remaining_tokens <= fit:
        return _whole(off, "rest fits one piece")
    floor = off.trade - TRADE_SLACK
    first = pieces_outlook(cost, fit, sit, knobs)
    fit_ms = cost.batch_ms(fit, sit.done_tokens, sit.decoders)
    stall = f"(max_stall_ms {knobs.max_stall_ms:g})"
    if first.trade >= floor and fit_ms <= STALL_SLACK * knobs.max_stall_ms:
        n, outlook = _stretch(cost, fit, first, sit, knobs)
        n_ms = cost.batch_ms(n, sit.done_tokens, sit.decoders)
        stretched = "" if n == fit else f", stretched from {fit} to reach trade {TARGET_TRADE:g}"
        return _choice(Strategy.PIECES, n, n_ms, outlook, off,
                       f"{n}-token pieces of ~{_dur(n_ms)} {stall}{stretched}{_keeps(outlook)}")
    why = f"{fit}-token pieces would take ~{_dur(fit_ms)} {stall}" + (
        "" if first.trade >= floor else f" and trade {first.trade:.2f} against off's {off.trade:.2f}")
    knee = _knee(cost, fit, sit, knobs, floor, off)
    if knee is not None:
        n, outlook = knee
        n_ms = cost.batch_ms(n, sit.done_tokens, sit.decoders)
        what = "larger pieces gain little" if n == fit else f"{n}-token pieces amortise the fixed part"
        return _choice(Strategy.PIECES if n == fit else Strategy.LARGER_PIECES, n, n_ms, outlook, off,
                       f"{why}; {what} (~{_dur(n_ms)} each){_keeps(outlook)}")
    hold = hold_outlook(cost, sit, knobs)
    if hold.wait_ms > 0:
        return _choice(Strategy.HOLD, 0, off.longest_batch_ms, hold, off,
                       f"{why}; no piece size helps the streams at a fair cost: "
                       f"held up to {_dur(hold.wait_ms)} like defer")
    return _whole(off, f"{why}; no piece size helps the streams at a fair cost and holding is off: "
                       f"forwarded whole")


def _stretch(cost: BatchCost, fit: int, first: Outlook, sit: Situation,
             knobs: ChunkKnobs) -> tuple[int, Outlook]:
    """Rule 4's size: the fitting piece, or the smallest larger one within the ramp and STRETCH ×
    `max_stall_ms` whose trade reaches TARGET_TRADE."""
    if first.trade >= TARGET_TRADE:
        return fit, first
    for n in piece_sizes(sit.piece_cap(knobs.n_batch)):
        if n <= fit or n >= sit.remaining_tokens:
            continue
        if cost.batch_ms(n, sit.done_tokens, sit.decoders) > STRETCH * knobs.max_stall_ms:
            break
        outlook = pieces_outlook(cost, n, sit, knobs)
        if outlook.trade >= TARGET_TRADE:
            return n, outlook
    return fit, first


def _knee(cost: BatchCost, fit: int, sit: Situation, knobs: ChunkKnobs,
          floor: float, off: Outlook) -> tuple[int, Outlook] | None:
    """Rule 5's size: the smallest from `fit` up that still makes two pieces or more, within TRADE_KNEE
    of the best trade, allowed by rule 3, and stalling the streams no longer than off would."""
    outlooks = [(n, pieces_outlook(cost, n, sit, knobs)) for n in piece_sizes(knobs.n_batch) if n >= fit]
    best = max(o.trade for _, o in outlooks)
    near = [(n, o) for n, o in outlooks
            if n < sit.remaining_tokens and o.trade >= max(min(best - TRADE_KNEE, TARGET_TRADE), floor)
            and o.longest_batch_ms <= off.longest_batch_ms * (1 + 1e-9)]
    return near[0] if near else None


def _whole(off: Outlook, reason: str) -> PieceChoice:
    return _choice(Strategy.WHOLE, 0, off.longest_batch_ms, off, off, reason)


def _choice(strategy: Strategy, piece: int, piece_ms: float, outlook: Outlook, off: Outlook,
            reason: str) -> PieceChoice:
    return PieceChoice(
        strategy=strategy, piece_tokens=piece, predicted_piece_ms=piece_ms,
        predicted_streams_share=outlook.streams_share, predicted_cold_factor=outlook.cold_factor,
        predicted_trade=outlook.trade, off_trade=off.trade,
        hold_ms=outlook.wait_ms if strategy is Strategy.HOLD else 0.0, reason=reason)


def _keeps(o: Outlook) -> str:
    return f": streams keep ~{o.streams_share:.0%}, the cold request takes ~{o.cold_factor:.1f}× alone"


def _dur(ms: float) -> str:
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _check(sit: Situation, knobs: ChunkKnobs) -> None:
    if sit.done_tokens < 0 or sit.remaining_tokens < 0 or sit.decoders < 0:
        raise ValueError(f"token counts and decoders must be >= 0, got {sit}")
    if knobs.n_batch < 1 or knobs.max_stall_ms <= 0 or knobs.max_hold_ms < 0:
        raise ValueError(f"need n_batch >= 1, max_stall_ms > 0, max_hold_ms >= 0, got {knobs}")
    if not 0 < knobs.prefill_share <= 1:
        raise ValueError(f"prefill_share must be in (0, 1], got {knobs.prefill_share}")
