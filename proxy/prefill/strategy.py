"""How a cold prompt goes on from here: pieces that fit `max_stall_ms`, larger pieces, a bounded hold,
catch-up pieces after it, or the whole rest at once. Chosen by what the streams and the cold request
each keep, from the outlooks `outlook.py` predicts with the batch-cost model. Pure: numbers in, a
`PieceChoice` out; the policy applies it.

With δ = 0: Q(n) = 1 - (C(n) - C_off)/(C(n) + P(n)). Chunking loses exactly the extra compute of its
smaller batches, (k - k_off) fixed parts: tiny pieces on a machine whose fixed part is 1.5 s lose
nearly everything, while pieces of n_batch reach off's trade. And Q ≥ Q_off - ε ⟺ F·(1 - S) ≤ 1 + ε·F:
the streams' stalled time, in units of the cold prompt alone, is at most what off stalls them plus
ε·F, the price of never freezing them. ε = TRADE_SLACK = 0.35: ordinary pieces trade about 0.9
on separate per-slot caches, but with one shared KV after a few thousand tokens the context read
makes the best pieces within 2 × `max_stall_ms` trade 0.6-0.7 (predicted and measured in the
set-up matrix), with the streams' gaps at 0.3-0.35 s; a floor of 0.75 turned them into 450-token
pieces that stalled the streams 0.8-0.9 s. The disasters it guards
against (tiny pieces on a busy machine) trade 0.1-0.5. A hold reaches off's trade too, and so do
pieces of n_batch, so the trade alone cannot choose between larger pieces and a hold: pieces win
when they stall the streams no longer than off (rule 5), since they also bound what the cold
request pays; otherwise catch-up pieces do, bounding both (rule 6), and a hold only when no size
catches up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.outlook import (
    BEHIND_SHARE,
    CATCH_UP,
    ChunkKnobs,
    Outlook,
    Situation,
    fitting_piece,
    hold_outlook,
    longest_hold_ms,
    off_outlook,
    piece_sizes,
    pieces_outlook,
)
from proxy.prefill.sizing import PIECE_ALIGN

STALL_SLACK = 2.0
"""Rule 4: pieces keep their promise while the next one is predicted within this × `max_stall_ms`
(the issue allows the streams' longest gap up to 2 × `max_stall_ms`)."""
TRADE_SLACK = 0.35
"""Rule 3: an option whose trade is below off's minus this is never chosen."""
TARGET_TRADE = 0.9
"""Rule 4: what fitting pieces should keep (the streams' share + the cold request's share); issue #8's aim."""
STRETCH = 1.6
"""Rule 4: how far past `max_stall_ms` a piece may grow to reach TARGET_TRADE, within the streams'
longest gap the issue allows (STALL_SLACK). Not all of it: a short turn's batch or a copy to RAM can
follow a piece before the streams' next token, and a fit errs. Measured (`bench contention --setups
all`, one run at 9151813): stretched to 1.9 ×, pieces of up to 304 ms gave gaps of 0.30-0.40 s
(over 2 × 160 ms on three set-ups of six); at 1.5 ×, 0.23-0.30 s. With one shared KV after 3,000
tokens (`bench pieces`, `-np 4 -kvu`) 64-token pieces take 186 ms and use the server at ~2/3 of a
whole prompt's rate, 128-token ones 302 ms at ~7/8."""
TRADE_KNEE = 0.05
"""Rule 5: a larger piece is worth its longer batch only while it gains more than this in trade."""
SPLIT_COST = 1.1
"""Rule 9: a chat turn's pieces back to back may take at most this × its rest sent whole, as the
batch cost prices them: its user waits for them, and each piece also pays a round trip and a
batch boundary the price leaves out. The what-if on fifteen recommended-layout `bench day` days:
at 1.25 the turns split took 0.1-0.4 s longer; at 1.1, 0.08-0.13 s on three, 0.06-0.42 s less on
two (fewer stalls beside them), while everyone's longest gap fell on seven (1.17 → 0.48 s the
most) and grew on none."""


class Strategy(enum.Enum):
    PIECES = "pieces"
    LARGER_PIECES = "larger_pieces"
    HOLD = "hold"
    WHOLE = "whole"
    CATCH_UP = "catch_up"
    SPLIT = "split"


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
     4. PIECES of the fitting piece when the piece is predicted within STALL_SLACK ×
        `max_stall_ms` and rule 3 allows them (or the stretched ones below); but when their trade
        is below TARGET_TRADE, the smallest larger piece (within the ramp) that reaches it while
        predicted within STRETCH × `max_stall_ms` (if none does, the one of those with the best
        trade): a longer batch that stops the fixed part from eating the cold request's time.
        When the fit has seen batches of one size only, this one piece is twice that size (within
        the ramp and STALL_SLACK × `max_stall_ms`): a probe, so the fit can tell the fixed part
        from the per-token part.
     5. Otherwise the pieces cannot keep their promise, and the trade decides. Bigger pieces amortise
        the fixed part: from the fitting piece up, take the smallest size that still cuts the rest in
        two or more, whose trade reaches TARGET_TRADE or is within TRADE_KNEE of the best size's
        (past it a bigger piece only lengthens the gaps), that rule 3 allows, and whose longest
        batch is no longer than off's (a piece that stalls the streams longer than off would is no
        help to them): LARGER_PIECES, or PIECES if it is the fitting piece itself.
     6. When no size qualifies: rule 8's CATCH_UP pieces if a size catches up (a hold would bet on
        the streams ending soon; in a chat they rarely do, and the cold request then lost the
        hold and the slots others took meanwhile: bench day, a 1,638-token first turn held 25 s,
        its first token after 46 s). Else HOLD, like `defer`: for at most `max_hold_ms`, and at
        most until the cold request, with rule 8's catch-up after the hold, would take
        HOLD_COLD_FACTOR × its time alone. Its worst case (the streams generate throughout) is
        off's trade, and they keep their full speed while it lasts.
     7. WHOLE otherwise (`max_hold_ms` = 0).
     8. (`catch_up_piece`: rule 6 asks it, and the policy asks it alone once a plan is not to be
        held: its hold ended with others still generating, or its rest is under `cold_tokens`.)
        CATCH_UP pieces: the smallest size whose pieces with BEHIND_SHARE's pauses take at most
        CATCH_UP × the rest whole, so the streams wait one piece at a time rather than the whole
        rest; WHOLE if it fits one or no size does.
     9. (`split_piece`: the policy asks it alone for a chat turn cold by its stall only.) SPLIT
        pieces back to back, no pause: the largest size whose batch keeps the streams' promise
        (STALL_SLACK × `max_stall_ms`), if its pieces take at most SPLIT_COST × the rest whole,
        else the smallest size whose pieces do, judged whatever rule 1's ramp allows and then cut
        to it; WHOLE if the rest fits that piece or none does.
    """
    _check(sit, knobs)
    fit = fitting_piece(cost, sit, knobs)
    off = off_outlook(cost, sit, knobs)
    if sit.remaining_tokens <= fit:
        return _whole(off, "rest fits one piece")
    floor = off.trade - TRADE_SLACK
    first = pieces_outlook(cost, fit, sit, knobs)
    fit_ms = cost.batch_ms(fit, sit.done_tokens, sit.decoders, sit.cells)
    stall = f"(max_stall_ms {knobs.max_stall_ms:g})"
    n, outlook = _stretch(cost, fit, first, sit, knobs)
    if outlook.trade >= floor and fit_ms <= STALL_SLACK * knobs.max_stall_ms:
        n_ms = cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells)
        said = f"{n}-token pieces of ~{_dur(n_ms)} {stall}" + ("" if n == fit else (
            f", stretched from {fit} " + ("to reach trade " if outlook.trade >= TARGET_TRADE
                                          else "towards trade ") + f"{TARGET_TRADE:g}"))
        probe = _probe(cost, n, sit, knobs)
        if probe is not None:
            n, outlook = probe, pieces_outlook(cost, probe, sit, knobs)
            n_ms = cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells)
            said += f"; this one {n} tokens, to measure what a larger batch costs"
        return _choice(Strategy.PIECES, n, n_ms, outlook, off, f"{said}{_keeps(outlook)}")
    why = f"{fit}-token pieces would take ~{_dur(fit_ms)} {stall}" + (
        "" if first.trade >= floor else f" and trade {first.trade:.2f} against off's {off.trade:.2f}")
    knee = _knee(cost, fit, sit, knobs, floor, off)
    if knee is not None:
        n, outlook = knee
        n_ms = cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells)
        what = "larger pieces gain little" if n == fit else f"{n}-token pieces amortise the fixed part"
        return _choice(Strategy.PIECES if n == fit else Strategy.LARGER_PIECES, n, n_ms, outlook, off,
                       f"{why}; {what} (~{_dur(n_ms)} each){_keeps(outlook)}")
    catch = catch_up_piece(cost, sit, knobs, why)
    if catch.strategy is Strategy.CATCH_UP:
        return catch
    hold_ms = longest_hold_ms(off, knobs)
    if hold_ms > 0:
        return _choice(Strategy.HOLD, 0, off.longest_batch_ms, hold_outlook(cost, sit, knobs), off,
                       f"{why}; no piece size helps the streams at a fair cost: "
                       f"held up to {_dur(hold_ms)} like defer", hold_ms=hold_ms)
    return _whole(off, f"{why}; no piece size helps the streams at a fair cost and holding is off: "
                       f"forwarded whole")


def catch_up_piece(cost: BatchCost, sit: Situation, knobs: ChunkKnobs, why: str) -> PieceChoice:
    """Rule 8: the streams' promise cannot be kept (rule 6), or a cold request is not to be held
    any longer (its hold ended with others still generating, or its rest is a short turn's work).
    Sent whole, its rest would freeze every stream for all of it; instead CATCH_UP pieces: the
    smallest size whose pieces, with BEHIND_SHARE's pauses (not `knobs.prefill_share`), take at
    most CATCH_UP × the rest sent whole, within rule 1's ramp. WHOLE when
    the rest fits that piece, or when no size catches up so (a fixed part so large that pieces
    would stall the streams about as long as the whole rest). `why` starts the reason."""
    _check(sit, knobs)
    knobs = replace(knobs, prefill_share=BEHIND_SHARE)
    off = off_outlook(cost, sit, knobs)
    for n in piece_sizes(knobs.n_batch):
        if n >= sit.remaining_tokens:
            break
        outlook = pieces_outlook(cost, n, sit, knobs)
        if outlook.compute_ms + outlook.wait_ms <= CATCH_UP * off.compute_ms:
            n = min(n, sit.piece_cap(knobs.n_batch))
            outlook = pieces_outlook(cost, n, sit, knobs)
            n_ms = cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells)
            slower = (outlook.compute_ms + outlook.wait_ms) / max(off.compute_ms, 1e-9)
            return _choice(Strategy.CATCH_UP, n, n_ms, outlook, off,
                           f"{why}; caught up in {n}-token pieces (~{_dur(n_ms)} each) with the "
                           f"streams' pauses between, not whole (~{_dur(off.longest_batch_ms)}): "
                           f"~{slower:.1f}× the rest's time whole")
    return _whole(off, f"{why}; the rest fits one piece" if sit.remaining_tokens <= PIECE_ALIGN
                  else f"{why}; no piece size catches up within {CATCH_UP:g}× the rest's time "
                       "whole: forwarded whole")


def split_piece(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> PieceChoice:
    """Rule 9: a chat turn under `cold_tokens` whose batch, sent whole, would stall the streams
    beyond their promise (STALL_SLACK × `max_stall_ms`), but not so long that it is fed like a
    cold request (the policy's rule 1). Its rest goes in pieces back to back: the streams have a
    token after each, so they wait one piece, not the whole rest, and the turn pays only each
    piece's fixed part, no pause (bench day, `-np 5`: `ann-5`'s 495-687 tokens left by her
    warm-up, sent whole, froze every stream 0.9-1.4 s; `cho-1`'s 728 tokens 0.66 s). The largest
    size within the promise if its pieces take at most SPLIT_COST × the rest whole, else the
    smallest size whose pieces do (a gap beyond the promise, shorter than the whole rest's);
    WHOLE when the rest fits that piece or no size does. The sizes are judged whatever rule 1's
    ramp allows, and the one chosen is then cut to the ramp, as rule 8 does: the ramp bounds how
    long one batch may run past its price, and the whole rest, its only other way, is one batch
    longer still (bench day, `-np 5`: after a warm-up whose largest piece was 128 tokens, `ann-5`'s
    687-token rest could be split only in pieces of 64-256, each dearer than 1.1× whole, and went
    whole, 1.2 s for every stream; the day's fitted cost priced 384-token pieces at ~1.07×)."""
    _check(sit, knobs)
    off = off_outlook(cost, sit, knobs)
    promise_ms = STALL_SLACK * knobs.max_stall_ms
    if off.longest_batch_ms <= promise_ms:
        return _whole(off, "rest fits one piece")
    affordable = []
    for n in piece_sizes(knobs.n_batch):
        if n >= sit.remaining_tokens:
            break
        outlook = pieces_outlook(cost, n, sit, knobs, pauses=False)
        if outlook.compute_ms <= SPLIT_COST * off.compute_ms:
            affordable.append((n, cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells)))
    if not affordable:
        return _whole(off, f"no piece size splits it within {SPLIT_COST:g}× its time whole: "
                           "sent whole")
    kept = [a for a in affordable if a[1] <= promise_ms]
    chosen = (kept[-1] if kept else affordable[0])[0]
    n = min(chosen, sit.piece_cap(knobs.n_batch))
    outlook = pieces_outlook(cost, n, sit, knobs, pauses=False)
    n_ms = cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells)
    slower = outlook.compute_ms / max(off.compute_ms, 1e-9)
    ramp = "" if n == chosen else f" ({chosen} once rule 1's ramp allows)"
    return _choice(Strategy.SPLIT, n, n_ms, outlook, off,
                   f"split in {n}-token pieces (~{_dur(n_ms)} each){ramp} back to back, not whole "
                   f"(~{_dur(off.longest_batch_ms)}): ~{slower:.2f}× its time whole")


def background_piece(cost: BatchCost, sit: Situation, knobs: ChunkKnobs) -> PieceChoice:
    """A background job's way on (the policy's rule 1): pieces that keep the streams' promise,
    whatever they cost the job: rule 4's fitting piece, stretched as rule 4 stretches it; WHOLE
    only when the rest fits one. Never larger pieces, a hold or catch-up pieces, which bound the
    cold request's own time: nobody reads a background job as it comes (bench day: translations
    cold by their stall went whole through rule 8, no size catching up, and froze four streams
    1.2-1.8 s)."""
    _check(sit, knobs)
    fit = fitting_piece(cost, sit, knobs)
    off = off_outlook(cost, sit, knobs)
    if sit.remaining_tokens <= fit:
        return _whole(off, "rest fits one piece")
    n, outlook = _stretch(cost, fit, pieces_outlook(cost, fit, sit, knobs), sit, knobs)
    n_ms = cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells)
    return _choice(Strategy.PIECES, n, n_ms, outlook, off,
                   f"a background job: {n}-token pieces of ~{_dur(n_ms)} (max_stall_ms "
                   f"{knobs.max_stall_ms:g}){_keeps(outlook)}")


def _stretch(cost: BatchCost, fit: int, first: Outlook, sit: Situation,
             knobs: ChunkKnobs) -> tuple[int, Outlook]:
    """Rule 4's size: the fitting piece if it reaches TARGET_TRADE; else the smallest larger one
    within the ramp and STRETCH × `max_stall_ms` that does, or, if none does, the one of them with
    the best trade (the largest: a bigger batch pays the fixed part, and the context read, fewer
    times)."""
    if first.trade >= TARGET_TRADE:
        return fit, first
    best = (fit, first)
    for n in piece_sizes(sit.piece_cap(knobs.n_batch)):
        if n <= fit or n >= sit.remaining_tokens:
            continue
        if cost.batch_ms(n, sit.done_tokens, sit.decoders, sit.cells) > STRETCH * knobs.max_stall_ms:
            break
        outlook = pieces_outlook(cost, n, sit, knobs)
        if outlook.trade >= TARGET_TRADE:
            return n, outlook
        if outlook.trade > best[1].trade:
            best = (n, outlook)
    return best


def _probe(cost: BatchCost, n: int, sit: Situation, knobs: ChunkKnobs) -> int | None:
    """Rule 4's probe: when the fit has seen one size only (`sit.probe`), one piece twice as large
    (within the ramp), if predicted within STALL_SLACK × `max_stall_ms`: the bound of any piece, by
    the same model that cannot yet tell how much of a batch is fixed."""
    if not sit.probe:
        return None
    size = min(2 * n, sit.piece_cap(knobs.n_batch)) // PIECE_ALIGN * PIECE_ALIGN
    if size <= n or size >= sit.remaining_tokens:
        return None
    if cost.batch_ms(size, sit.done_tokens, sit.decoders, sit.cells) > STALL_SLACK * knobs.max_stall_ms:
        return None
    return size


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
            reason: str, hold_ms: float = 0.0) -> PieceChoice:
    return PieceChoice(
        strategy=strategy, piece_tokens=piece, predicted_piece_ms=piece_ms,
        predicted_streams_share=outlook.streams_share, predicted_cold_factor=outlook.cold_factor,
        predicted_trade=outlook.trade, off_trade=off.trade, hold_ms=hold_ms, reason=reason)


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
