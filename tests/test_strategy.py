"""The piece strategy, rule by rule: each test class is one numbered rule of `choose_piece`, then the
outlook formulas and the synthetic cost shapes end to end (observations → fitted model → choice).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from proxy.prefill.batch_cost import PRIOR, BatchCost
from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.outlook import (
    CATCH_UP,
    HOLD_COLD_FACTOR,
    ChunkKnobs,
    Situation,
    fitting_piece,
    hold_outlook,
    off_outlook,
    piece_sizes,
    pieces_outlook,
)
from proxy.prefill.strategy import (
    SPLIT_COST,
    STALL_SLACK,
    STRETCH,
    TARGET_TRADE,
    TRADE_SLACK,
    Strategy,
    catch_up_piece,
    choose_piece,
    split_piece,
)
from tests.test_batch_cost import BUSY, CPU, GPU, fitted

KNOBS = ChunkKnobs(max_stall_ms=160.0, n_batch=2048, prefill_share=0.55, max_hold_ms=30_000.0)
COLD = Situation(done_tokens=0, remaining_tokens=3300, decoders=3)
"""The benchmark's cold prompt (3,300 tokens, nothing cached) beside three streams."""
FIXED_HEAVY = BatchCost(fixed_ms=100.0, per_token_ms=0.5, per_token_per_kctx_ms=0.0, per_decoder_ms=0.0)
"""A 64-token piece fits 160 ms, but each piece pays a fixed part as large as 200 tokens."""
ATTENTION_BOUND = BatchCost(fixed_ms=15.0, per_token_ms=1.2, per_token_per_kctx_ms=0.47, per_decoder_ms=0.0)
"""Attention to the prefix is all that grows with it: late in a long prompt a piece costs the same per
token whatever its size."""
SHAPES = {"cpu": CPU, "gpu": GPU, "busy": BUSY, "fixed-heavy": FIXED_HEAVY, "prior": PRIOR}


def choose(cost: BatchCost, sit: Situation = COLD, **knobs: Any) -> tuple[Strategy, int]:
    choice = choose_piece(cost, sit, dataclasses.replace(KNOBS, **knobs))
    return choice.strategy, choice.piece_tokens


def at(done: int, rest: int, decoders: int = 3) -> Situation:
    return Situation(done_tokens=done, remaining_tokens=rest, decoders=decoders)


class TestRule1PieceSizes:
    def test_multiples_of_64_up_to_n_batch(self) -> None:
        assert piece_sizes(2048) == list(range(64, 2049, 64))
        assert piece_sizes(1000)[-1] == 960
        assert piece_sizes(32) == [64]

    def test_fitting_piece_is_the_largest_within_max_stall(self) -> None:
        assert fitting_piece(CPU, at(0, 3300), dataclasses.replace(KNOBS, max_stall_ms=320)) == 320
        assert CPU.batch_ms(320, 0, 3) <= 320 < CPU.batch_ms(384, 0, 3)

    def test_capped_by_n_batch(self) -> None:
        assert fitting_piece(GPU, COLD, KNOBS) == 2048
        assert fitting_piece(GPU, COLD, dataclasses.replace(KNOBS, n_batch=512)) == 512

    def test_at_least_64(self) -> None:
        assert fitting_piece(BUSY, COLD, KNOBS) == 64

    def test_at_most_twice_the_largest_piece_measured(self) -> None:
        """A GPU model says 2048 fit; after a 64-token piece the next is 128, then 256, …"""
        ramp = [fitting_piece(GPU, dataclasses.replace(COLD, largest_piece=n), KNOBS)
                for n in (64, 128, 1024, 2048)]
        assert ramp == [128, 256, 2048, 2048]

    def test_the_prior_gives_the_old_default(self) -> None:
        # 500 tok/s × 160 ms = 80 tokens, rounded down to 64.
        assert fitting_piece(PRIOR, COLD, KNOBS) == 64

    @pytest.mark.parametrize("name", SHAPES)
    def test_grows_with_max_stall(self, name: str) -> None:
        sizes = [fitting_piece(SHAPES[name], at(3000, 3000), dataclasses.replace(KNOBS, max_stall_ms=ms))
                 for ms in range(20, 5000, 20)]
        assert sizes == sorted(sizes)


class TestRule2RestFitsOnePiece:
    def test_whole(self) -> None:
        choice = choose_piece(GPU, at(3000, 300), KNOBS)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.WHOLE, 0)
        assert choice.reason == "rest fits one piece"
        assert choice.predicted_cold_factor == 1.0

    def test_nothing_left(self) -> None:
        assert choose(CPU, at(3300, 0)) == (Strategy.WHOLE, 0)


class TestRule3NeverWorseThanOff:
    def test_tiny_pieces_on_a_busy_machine_are_worse_than_off(self) -> None:
        # the run: 64-token pieces took the cold request many times its time alone.
        tiny = pieces_outlook(BUSY, 64, COLD, KNOBS)
        assert tiny.cold_factor > 10
        assert tiny.trade < off_outlook(BUSY, COLD, KNOBS).trade - TRADE_SLACK

    def test_fitting_pieces_refused_when_their_fixed_parts_cost_too_much(self) -> None:
        # 64 tokens ~132 ms, within 2 × 80; the largest stretched piece (1.9 × 80) trades too little.
        assert FIXED_HEAVY.batch_ms(64, 0) < 2 * 80
        assert choose(FIXED_HEAVY, max_stall_ms=80)[0] is Strategy.LARGER_PIECES

    def test_a_stretch_within_the_gap_comes_before_larger_pieces(self) -> None:
        # at max_stall_ms 160, 64-token pieces trade 0.60; 256 tokens (~228 ms) trade 0.79.
        choice = choose_piece(FIXED_HEAVY, COLD, KNOBS)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.PIECES, 256)
        assert pieces_outlook(FIXED_HEAVY, 64, COLD, KNOBS).trade < choice.off_trade - TRADE_SLACK
        assert choice.predicted_trade >= choice.off_trade - TRADE_SLACK

    @pytest.mark.parametrize("name", SHAPES)
    @pytest.mark.parametrize("done,rest", [(0, 3300), (3000, 3000), (6000, 3600), (9000, 600),
                                           (0, 16000), (0, 1500)])
    def test_no_choice_below_the_floor(self, name: str, done: int, rest: int) -> None:
        choice = choose_piece(SHAPES[name], at(done, rest), KNOBS)
        assert choice.predicted_trade >= choice.off_trade - TRADE_SLACK


class TestRule4Pieces:
    def test_cpu_pieces_stretched_to_the_target_trade(self) -> None:
        # 128 tokens fit 160 ms at the start; 192 (~169 ms) reach a trade of 0.9.
        assert fitting_piece(CPU, COLD, KNOBS) == 128
        choice = choose_piece(CPU, COLD, KNOBS)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.PIECES, 192)
        assert choice.predicted_piece_ms == pytest.approx(CPU.batch_ms(192, 0, 3))
        assert choice.predicted_trade >= TARGET_TRADE > pieces_outlook(CPU, 128, COLD, KNOBS).trade
        assert choice.reason.startswith("192-token pieces of ~169 ms (max_stall_ms 160), stretched "
                                        "from 128 to reach trade 0.9: streams keep ~44%")

    def test_a_probe_doubles_the_piece_when_the_fit_has_seen_one_size(self) -> None:
        # the prior takes 64 tokens as ~148 ms: twice that is within 2 × 160 as predicted.
        probed = choose_piece(PRIOR, dataclasses.replace(COLD, probe=True), KNOBS)
        assert choose(PRIOR) == (Strategy.PIECES, 64)
        assert (probed.strategy, probed.piece_tokens) == (Strategy.PIECES, 128)
        assert probed.reason.endswith("this one 128 tokens, to measure what a larger batch costs: "
                                      "streams keep ~44%, the cold request takes ~1.9× alone")
        assert probed.reason.startswith("64-token pieces of ~148 ms (max_stall_ms 160); this one")

    def test_no_probe_past_twice_max_stall(self) -> None:
        # after 3,000 tokens 128-token pieces take ~293 ms: a 256-token probe would stall ~520 ms.
        sit = dataclasses.replace(at(3000, 3600), probe=True)
        assert choose_piece(CPU, sit, KNOBS).piece_tokens == 128

    def test_the_best_stretch_when_none_reaches_the_target(self) -> None:
        # after 2,000 tokens with one shared KV: 64 tokens ~140 ms, 128 ~233 ms (within 1.6 × 160),
        # neither reaches 0.9; the larger one pays the fixed part and the context read half as often.
        sit = at(2000, 4600)
        choice = choose_piece(CPU, sit, KNOBS)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.PIECES, 128)
        assert choice.predicted_piece_ms <= STRETCH * 160 < CPU.batch_ms(192, 2000, 3)
        assert pieces_outlook(CPU, 64, sit, KNOBS).trade < choice.predicted_trade < TARGET_TRADE
        assert "stretched from 64 towards trade 0.9" in choice.reason

    def test_gpu_pieces_fill_max_stall_up_to_n_batch(self) -> None:
        choice = choose_piece(GPU, COLD, KNOBS)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.PIECES, 2048)
        assert choice.predicted_trade == pytest.approx(choice.off_trade)

    def test_over_max_stall_but_within_twice(self) -> None:
        assert 160 < ATTENTION_BOUND.batch_ms(64, 3000, 3) <= 320
        assert choose(ATTENTION_BOUND, at(3000, 3000)) == (Strategy.PIECES, 64)


class TestRule5LargerPieces:
    def test_two_noisy_pieces_make_no_leap(self) -> None:
        # measured on -np 4 (2026-11-30): the first two 64-token pieces took 92 and 169 ms (a short
        # turn's batch beside the second). With the prior at 1 % of a sample, the fit read the
        # difference as a context read of 200 ms per 1,000 tokens and chose 1,088-token pieces
        # (1.4 s each); at 3 % the prior keeps such a guess from two samples in check.
        model = BatchCostModel()
        model.observe_piece(64, 0, 91.9, 1)
        model.observe_piece(64, 64, 169.0, 1)
        sit = Situation(done_tokens=128, remaining_tokens=3131, decoders=1, largest_piece=64)
        choice = choose_piece(model.cost, sit, KNOBS)
        assert choice.piece_tokens <= 128
        assert choice.strategy in (Strategy.PIECES, Strategy.LARGER_PIECES)

    def test_busy_machine(self) -> None:
        choice = choose_piece(BUSY, COLD, KNOBS)
        assert choice.strategy is Strategy.LARGER_PIECES
        assert choice.piece_tokens > 64
        assert choice.predicted_trade >= TARGET_TRADE
        off = off_outlook(BUSY, COLD, KNOBS)
        assert pieces_outlook(BUSY, choice.piece_tokens, COLD, KNOBS).longest_batch_ms <= off.longest_batch_ms
        assert "amortise the fixed part" in choice.reason

    def test_the_smallest_size_that_reaches_the_target_trade(self) -> None:
        strategy, n = choose(FIXED_HEAVY, max_stall_ms=80)
        trades = {m: pieces_outlook(FIXED_HEAVY, m, COLD, KNOBS).trade for m in piece_sizes(2048)}
        assert strategy is Strategy.LARGER_PIECES
        assert trades[n] >= TARGET_TRADE > trades[n - 64]

    def test_the_fitting_piece_when_larger_ones_gain_little(self) -> None:
        # late in a long prompt on the CPU: attention dominates and does not depend on the piece size.
        choice = choose_piece(ATTENTION_BOUND, at(9000, 600), KNOBS)
        assert choice.predicted_piece_ms > 2 * 160
        assert (choice.strategy, choice.piece_tokens) == (Strategy.PIECES, 64)
        assert "larger pieces gain little" in choice.reason


class TestRule6Hold:
    def test_busy_machine_with_less_than_a_batch_left(self) -> None:
        # cutting 1,500 tokens in two only adds a 1.5 s fixed part: better let the streams run.
        choice = choose_piece(BUSY, at(0, 1500), KNOBS)
        alone = BUSY.prompt_ms(1500, 0, 2048, 3)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.HOLD, 0)
        # the catch-up after the hold (up to CATCH_UP × its time) is inside HOLD_COLD_FACTOR.
        assert choice.hold_ms == pytest.approx((HOLD_COLD_FACTOR - CATCH_UP) * alone)
        assert choice.predicted_cold_factor == pytest.approx(HOLD_COLD_FACTOR)
        assert choice.predicted_trade == pytest.approx(choice.off_trade)
        assert choice.reason.endswith("held up to 5.7 s like defer")

    def test_bounded_by_max_hold(self) -> None:
        choice = choose_piece(BUSY, at(0, 1500), dataclasses.replace(KNOBS, max_hold_ms=2000.0))
        assert (choice.strategy, choice.hold_ms) == (Strategy.HOLD, 2000.0)


class TestRule7Whole:
    def test_when_holding_is_off(self) -> None:
        choice = choose_piece(BUSY, at(0, 1500), dataclasses.replace(KNOBS, max_hold_ms=0.0))
        assert (choice.strategy, choice.piece_tokens, choice.hold_ms) == (Strategy.WHOLE, 0, 0.0)
        assert choice.reason.endswith("holding is off: forwarded whole")


class TestRule8CatchUp:
    """After a hold, or for a rest under `cold_tokens`, with the streams still generating."""

    BEHIND = dataclasses.replace(KNOBS, prefill_share=0.8)

    def test_the_smallest_pieces_within_catch_up_of_the_rest_whole(self) -> None:
        sit = at(2048, 2000, decoders=4)
        choice = catch_up_piece(CPU, sit, self.BEHIND, "its hold ended with 4 generating")
        off = off_outlook(CPU, sit, self.BEHIND)

        def took(n: int) -> float:
            o = pieces_outlook(CPU, n, sit, self.BEHIND)
            return o.compute_ms + o.wait_ms

        n = choice.piece_tokens
        assert choice.strategy is Strategy.CATCH_UP and 64 <= n < 2000
        assert took(n) <= CATCH_UP * off.compute_ms < took(n - 64)
        assert choice.predicted_piece_ms < off.longest_batch_ms / 2  # the streams wait a piece
        assert choice.reason.startswith("its hold ended with 4 generating; caught up in "
                                        f"{n}-token pieces")

    def test_within_the_ramp(self) -> None:
        sit = dataclasses.replace(at(2048, 2000, decoders=4), largest_piece=64)
        choice = catch_up_piece(CPU, sit, self.BEHIND, "why")
        assert (choice.strategy, choice.piece_tokens) == (Strategy.CATCH_UP, 128)

    def test_the_ramp_never_cuts_a_piece_under_a_tile(self) -> None:
        """bench day: a turn estimated cold whose first piece found its tokens cached computed one;
        from it the ramp allowed pieces of 2, which end one token on when they start off a
        multiple of 64: 265 pieces of one token, 104 s to its first token."""
        sit = dataclasses.replace(at(577, 1700, decoders=4), largest_piece=1)
        choice = catch_up_piece(CPU, sit, self.BEHIND, "why")
        assert choice.strategy is Strategy.CATCH_UP and choice.piece_tokens >= 64

    def test_whole_when_no_piece_stalls_the_streams_less(self) -> None:
        # every batch starts with 1.5 s: two pieces of a 1,184-token rest cost 3 s against 1.9 s.
        slow = BatchCost(fixed_ms=1500.0, per_token_ms=0.3, per_token_per_kctx_ms=0.0,
                         per_decoder_ms=0.0)
        choice = catch_up_piece(slow, at(1216, 1184), self.BEHIND, "why")
        assert (choice.strategy, choice.piece_tokens) == (Strategy.WHOLE, 0)
        assert choice.reason == ("why; no piece size catches up within 1.5× the rest's time "
                                 "whole: forwarded whole")

    def test_whole_when_the_rest_fits_one_piece(self) -> None:
        choice = catch_up_piece(CPU, at(2048, 40), self.BEHIND, "why")
        assert (choice.strategy, choice.reason) == (Strategy.WHOLE, "why; the rest fits one piece")


class TestRule9Split:
    """A chat turn cold by its stall only: its rest in pieces back to back, no pause."""

    def test_the_largest_pieces_within_the_streams_promise_at_a_fair_cost(self) -> None:
        sit = at(0, 1000, decoders=2)  # a mid-size turn beside two streams
        choice = split_piece(CPU, sit, KNOBS)
        off = off_outlook(CPU, sit, KNOBS)
        n = choice.piece_tokens
        assert choice.strategy is Strategy.SPLIT and 64 <= n < 1000
        assert choice.predicted_piece_ms <= STALL_SLACK * KNOBS.max_stall_ms
        assert CPU.batch_ms(n + 64, 0, 2) > STALL_SLACK * KNOBS.max_stall_ms
        back_to_back = pieces_outlook(CPU, n, sit, KNOBS, pauses=False)
        assert back_to_back.compute_ms <= SPLIT_COST * off.compute_ms
        assert choice.predicted_piece_ms < off.longest_batch_ms / 2  # the streams wait a piece
        assert choice.reason.startswith(f"split in {n}-token pieces")

    def test_beyond_the_promise_the_smallest_pieces_it_can_afford(self) -> None:
        """A fixed part near the promise: pieces within it would cost the turn too much."""
        heavy = BatchCost(fixed_ms=75.0, per_token_ms=1.0, per_token_per_kctx_ms=0.0,
                          per_decoder_ms=0.0)
        sit = at(0, 1500, decoders=2)
        choice = split_piece(heavy, sit, KNOBS)
        off = off_outlook(heavy, sit, KNOBS)

        def took(n: int) -> float:
            return pieces_outlook(heavy, n, sit, KNOBS, pauses=False).compute_ms

        n = choice.piece_tokens
        assert choice.strategy is Strategy.SPLIT
        assert choice.predicted_piece_ms > STALL_SLACK * KNOBS.max_stall_ms
        assert took(n) <= SPLIT_COST * off.compute_ms < took(n - 64)

    def test_after_a_warm_up_s_small_pieces_the_ramp_cuts_a_piece_never_sends_the_rest_whole(
            self) -> None:
        """bench day, `-np 5`: `ann-5`'s 687 tokens after a warm-up whose largest piece was 128.
        The day's fitted cost prices pieces of up to 256 (the ramp) over SPLIT_COST × whole, and
        384-token ones within it; sent whole, every stream froze 1.2 s."""
        fitted = BatchCost(fixed_ms=0.0, per_token_ms=0.76, per_token_per_kctx_ms=0.406,
                           per_decoder_ms=8.2, per_kctx_ms=25.2)
        sit = Situation(done_tokens=1792, remaining_tokens=687, decoders=4, largest_piece=128)
        off = off_outlook(fitted, sit, KNOBS)

        def took(n: int) -> float:
            return pieces_outlook(fitted, n, sit, KNOBS, pauses=False).compute_ms

        assert took(256) > SPLIT_COST * off.compute_ms >= took(384)
        choice = split_piece(fitted, sit, KNOBS)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.SPLIT, 256)
        assert choice.predicted_piece_ms < off.longest_batch_ms / 2
        assert "(384 once rule 1's ramp allows)" in choice.reason
        unramped = split_piece(fitted, dataclasses.replace(sit, largest_piece=256), KNOBS)
        assert (unramped.strategy, unramped.piece_tokens) == (Strategy.SPLIT, 384)

    def test_whole_when_no_size_splits_it_at_a_fair_cost(self) -> None:
        slow = BatchCost(fixed_ms=1500.0, per_token_ms=0.3, per_token_per_kctx_ms=0.0,
                         per_decoder_ms=0.0)
        choice = split_piece(slow, at(1216, 700), KNOBS)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.WHOLE, 0)
        assert choice.reason == "no piece size splits it within 1.1× its time whole: sent whole"

    def test_whole_when_the_rest_fits_one_piece(self) -> None:
        choice = split_piece(CPU, at(2048, 64), KNOBS)
        assert (choice.strategy, choice.piece_tokens) == (Strategy.WHOLE, 0)


class TestOutlook:
    COST = BatchCost(fixed_ms=100.0, per_token_ms=1.0, per_token_per_kctx_ms=0.0, per_decoder_ms=0.0)
    SIT = Situation(done_tokens=0, remaining_tokens=1000, decoders=2)
    KNOBS = ChunkKnobs(max_stall_ms=160.0, n_batch=2048, prefill_share=0.5, max_hold_ms=500.0)

    def test_pieces_by_hand(self) -> None:
        # two pieces of 500: 600 ms each; one pause of 600 ms after the first; alone 1,100 ms.
        o = pieces_outlook(self.COST, 500, self.SIT, self.KNOBS)
        assert (o.compute_ms, o.wait_ms, o.longest_batch_ms) == pytest.approx((1200, 600, 600))
        assert o.streams_share == pytest.approx(600 / 1800)
        assert o.cold_factor == pytest.approx(1800 / 1100)
        assert o.trade == pytest.approx(600 / 1800 + 1100 / 1800)

    def test_decode_steps_inside_batches_count_when_known(self) -> None:
        sit = dataclasses.replace(self.SIT, decode_step_ms=50.0)
        o = pieces_outlook(self.COST, 500, sit, self.KNOBS)
        assert o.streams_share == pytest.approx((600 + 2 * 50) / 1800)
        assert off_outlook(self.COST, sit, self.KNOBS).streams_share == pytest.approx(50 / 1100)

    def test_off_and_hold(self) -> None:
        off = off_outlook(self.COST, self.SIT, self.KNOBS)
        assert (off.compute_ms, off.wait_ms, off.streams_share, off.cold_factor) == (1100, 0, 0, 1)
        hold = hold_outlook(self.COST, self.SIT, self.KNOBS)
        # held 500 ms, then catch-up pieces taking up to 1.5 × 1,100 ms: the extra 550 ms is theirs.
        assert hold.streams_share == pytest.approx((500 + 550) / (1050 + 1100))
        assert hold.cold_factor == pytest.approx((1050 + 1100) / 1100)
        assert hold.trade == pytest.approx(1.0)

    @pytest.mark.parametrize("n", [64, 256, 1024])
    def test_chunking_loses_exactly_its_extra_compute(self, n: int) -> None:
        o = pieces_outlook(CPU, n, COLD, KNOBS)
        off = off_outlook(CPU, COLD, KNOBS)
        assert o.trade == pytest.approx(1 - (o.compute_ms - off.compute_ms) / (o.compute_ms + o.wait_ms))


class TestShapesEndToEnd:
    """Observations of a known shape → the fitted model → the choice."""

    def test_cpu(self) -> None:
        model = fitted(CPU)
        assert choose(model.cost) == (Strategy.PIECES, 192)
        assert choose(model.cost, max_stall_ms=320) == (Strategy.PIECES, 320)

    def test_gpu(self) -> None:
        assert choose(fitted(GPU).cost) == (Strategy.PIECES, 2048)

    def test_busy_machine(self) -> None:
        choice = choose_piece(fitted(BUSY).cost, COLD, KNOBS)
        assert choice.strategy in (Strategy.LARGER_PIECES, Strategy.HOLD)
        assert choice.piece_tokens != 64
        assert choice.predicted_trade >= min(TARGET_TRADE, choice.off_trade) - 1e-6

    @pytest.mark.parametrize("name", ["cpu", "gpu"])
    def test_pieces_grow_with_max_stall(self, name: str) -> None:
        cost = fitted(SHAPES[name]).cost
        choices = [choose_piece(cost, at(3000, 6000), dataclasses.replace(KNOBS, max_stall_ms=ms))
                   for ms in range(100, 3000, 50)]
        sizes = [c.piece_tokens for c in choices if c.strategy is Strategy.PIECES]
        assert len(sizes) > 10 and sizes == sorted(sizes)


class TestChecks:
    @pytest.mark.parametrize("knobs", [dict(n_batch=0), dict(max_stall_ms=0.0), dict(prefill_share=0.0),
                                       dict(prefill_share=1.5), dict(max_hold_ms=-1.0)])
    def test_bad_knobs_are_errors(self, knobs: dict[str, Any]) -> None:
        with pytest.raises(ValueError):
            choose(CPU, **knobs)

    def test_bad_situation_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="must be >= 0"):
            choose(CPU, at(-1, 100))
