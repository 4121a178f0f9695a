"""The batch-cost model: its form, its prior, and its fit to synthetic cost shapes.

Observations are generated from a known `BatchCost` (exactly, or with seeded noise) and fed in; the
fit is checked against that truth. No server, no clock.
"""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest

from proxy.prefill.batch_cost import PRIOR, BatchCost
from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.nnls import every_support, nonnegative_lstsq

CPU = BatchCost(fixed_ms=10.0, per_token_ms=0.8, per_token_per_kctx_ms=0.31, per_decoder_ms=0.0,
                per_kctx_ms=19.6)
"""The testbed's CPU with one shared KV (`bench pieces --server-args "-np 4 -kvu"`, docs/prefill.md):
reading the prefix dominates; 64 tokens after a 3,000-token prefix took 186 ms, 512 after 6,000
1,629 ms."""
GPU = BatchCost(fixed_ms=20.0, per_token_ms=0.02, per_token_per_kctx_ms=0.0, per_decoder_ms=0.0)
"""A small batch costs about one decode step; a 2,048-token one ~61 ms."""
BUSY = BatchCost(fixed_ms=1500.0, per_token_ms=1.2, per_token_per_kctx_ms=0.47, per_decoder_ms=0.0,
                 per_kctx_ms=19.6)
"""The CPU with another process on its cores: every batch starts with 1.5 s."""

PIECES = [(n, ctx, d) for n in (64, 128, 256, 512, 1024) for ctx in (0, 1000, 3000, 6000) for d in (0, 3)]
PREFILLS = [(3300, 0, 2048), (40, 2000, 2048), (9600, 500, 2048)]
GRID = [(n, ctx, 3) for n in (64, 256, 2048) for ctx in (0, 3000, 9000)]


def feed(model: BatchCostModel, truth: BatchCost, count: int, *, noise: float = 0.0,
         seed: int = 1) -> None:
    """`count` observations of `truth`: the piece shapes in turn, every fifth a finished prefill."""
    rng = random.Random(seed)
    for i in range(count):
        jitter = 1.0 + rng.uniform(-noise, noise)
        if i % 5 == 4:
            n, cached, n_batch = PREFILLS[i // 5 % len(PREFILLS)]
            model.observe_prefill(n, cached, truth.prompt_ms(n, cached, n_batch) * jitter, n_batch)
        else:
            n, ctx, d = PIECES[i % len(PIECES)]
            model.observe_piece(n, ctx, truth.batch_ms(n, ctx, d) * jitter, d)


def fitted(truth: BatchCost, count: int = 60, *, noise: float = 0.0, seed: int = 1) -> BatchCostModel:
    model = BatchCostModel()
    feed(model, truth, count, noise=noise, seed=seed)
    return model


def worst_error(model: BatchCostModel, truth: BatchCost) -> float:
    return max(abs(model.cost.batch_ms(*s) / truth.batch_ms(*s) - 1) for s in GRID)


class TestForm:
    def test_one_batch(self) -> None:
        cost = BatchCost(10.0, 2.0, 0.5, 3.0, 7.0)
        # 10 + 2·100 + 0.5·100·(1000 + 50)/1000 + 3·4 + 7·1000/1000
        assert cost.batch_ms(100, 1000, 4) == pytest.approx(10 + 200 + 52.5 + 12 + 7)

    def test_the_measured_pieces(self) -> None:
        # bench pieces, -np 4 -kvu, one stream: 64 tokens after 3,000: 186 ms; 512 after 6,448: 1,629 ms.
        assert CPU.batch_ms(64, 3000) == pytest.approx(186, rel=0.05)
        assert CPU.batch_ms(512, 6448) == pytest.approx(1629, rel=0.05)

    def test_small_pieces_at_a_long_prefix_pay_for_reading_it(self) -> None:
        # per token, 64-token pieces after 6,000 cost ~40 % more than 512-token ones (4.6 against
        # 3.2 ms measured): the context is read once per batch, whatever its size.
        per_token = {n: CPU.batch_ms(n, 6000) / n for n in (64, 512)}
        assert per_token[64] > 1.3 * per_token[512]

    def test_a_prompt_is_the_sum_of_its_batches(self) -> None:
        cost = BatchCost(10.0, 2.0, 0.5, 3.0, 7.0)
        done, total = 700, 0.0
        for n in (512, 512, 176):
            total += cost.batch_ms(n, done, 2)
            done += n
        assert cost.prompt_ms(1200, 700, 512, 2) == pytest.approx(total)


SHARED = BatchCost(fixed_ms=10.0, per_token_ms=0.8, per_token_per_kctx_ms=0.31, per_decoder_ms=30.0,
                   per_kctx_ms=19.6, per_token_per_kcells_ms=0.16, per_kcells_ms=25.0)
"""The CPU with one shared KV as `slotwise whatif` measured it from the server log: every prompt
token scans the other slots' cells (0.16 ms per 1,000), and each batch pays 25 ms per 1,000 cells of
the decoding slots riding in its query tile."""


class TestOtherSlotsCells:
    """bench day, one shared KV: a 640-token piece predicted at 888 ms took 3.27 s beside three
    streams whose histories filled the cache; the model had no term for their cells."""

    @staticmethod
    def day(truth: BatchCost, count: int = 60) -> BatchCostModel:
        """Pieces and prefills beside three streams whose histories grow from 1,000 to 15,000
        cells, as a chat day's do."""
        model = BatchCostModel()
        for i in range(count):
            cells = 1000 + 14000 * i // count
            n, ctx, _ = PIECES[i % len(PIECES)]
            model.observe_piece(n, ctx, truth.batch_ms(n, ctx, 3, cells), 3, cells)
        return model

    def test_a_piece_beside_many_cells_is_priced_for_them(self) -> None:
        model = self.day(SHARED)
        for n in (64, 640):
            assert model.cost.batch_ms(n, 500, 3, 15000) == pytest.approx(
                SHARED.batch_ms(n, 500, 3, 15000), rel=0.1)

    def test_with_a_kv_per_slot_the_cells_cost_nothing(self) -> None:
        model = self.day(CPU)
        assert model.cost.batch_ms(640, 500, 3, 15000) == pytest.approx(
            model.cost.batch_ms(640, 500, 3, 0), rel=0.05)

    def test_a_finished_prefill_pays_them_in_every_batch(self) -> None:
        assert SHARED.prompt_ms(4096, 0, 2048, 3, 10000) == pytest.approx(
            SHARED.batch_ms(2048, 0, 3, 10000) + SHARED.batch_ms(2048, 2048, 3, 10000))


class TestPrior:
    def test_before_any_sample_the_prior_rules(self) -> None:
        model = BatchCostModel()
        fit = model.describe()
        assert model.cost == PRIOR
        assert (fit.source, fit.samples, fit.in_fit, fit.median_error) == ("prior", 0, 0, None)

    def test_prior_is_about_the_old_500_tokens_per_second(self) -> None:
        assert 256 / PRIOR.batch_ms(256, 0) * 1000 == pytest.approx(500, rel=0.05)

    def test_one_sample_moves_the_fit_through_it(self) -> None:
        model = BatchCostModel()
        model.observe_piece(64, 0, GPU.batch_ms(64, 0))
        assert model.cost.batch_ms(64, 0) == pytest.approx(GPU.batch_ms(64, 0), rel=0.05)
        assert model.describe().source == "fitted"

    def test_alike_samples_keep_the_priors_proportions(self) -> None:
        # every piece 64 tokens: the fixed and per-token parts cannot be told apart by the samples.
        model = BatchCostModel()
        for ctx in range(0, 3300, 64):
            model.observe_piece(64, ctx, BUSY.batch_ms(64, ctx))
        cost = model.cost
        assert model.cost.batch_ms(64, 2000) == pytest.approx(BUSY.batch_ms(64, 2000), rel=0.02)
        assert cost.fixed_ms > 0 and cost.per_token_ms > 0
        assert cost.fixed_ms / (64 * cost.per_token_ms) == pytest.approx(
            PRIOR.fixed_ms / (64 * PRIOR.per_token_ms), rel=0.5)


class TestFit:
    @pytest.mark.parametrize("truth", [CPU, GPU, BUSY], ids=["cpu", "gpu", "busy"])
    def test_recovers_the_shape(self, truth: BatchCost) -> None:
        model = fitted(truth)
        assert worst_error(model, truth) < 0.02
        assert model.cost.fixed_ms == pytest.approx(truth.fixed_ms, rel=0.1, abs=1.0)
        assert model.cost.per_token_ms == pytest.approx(truth.per_token_ms, rel=0.1)
        assert model.cost.per_kctx_ms == pytest.approx(truth.per_kctx_ms, rel=0.1, abs=0.5)

    def test_gpu_fixed_part_dominates_small_batches(self) -> None:
        cost = fitted(GPU).cost
        assert cost.batch_ms(2048, 0) < 3 * cost.batch_ms(64, 0)

    @pytest.mark.parametrize("seed", range(5))
    def test_noisy_samples_fit_within_the_noise(self, seed: int) -> None:
        # ±20 % on every sample; the grid reaches past the samples (2,048 tokens, a 9,000 prefix).
        assert worst_error(fitted(CPU, 120, noise=0.2, seed=seed), CPU) < 0.2


class TestNonNegative:
    @pytest.mark.parametrize("seed", range(8))
    def test_coefficients_never_negative_under_noise(self, seed: int) -> None:
        no_fixed = BatchCost(0.0, 1.0, 0.3, 0.0)
        model = BatchCostModel()
        feed(model, no_fixed, 80, noise=0.4, seed=seed)
        assert min(model.cost.as_tuple()) >= 0

    def test_solver_clamps_at_zero(self) -> None:
        # unconstrained: x = (1, -1); with x >= 0 the best is (1, 0).
        x = nonnegative_lstsq(np.eye(2), np.array([1.0, -1.0]))
        assert x == pytest.approx([1.0, 0.0])

    @pytest.mark.parametrize("seed", range(40))
    def test_active_set_finds_what_tryingevery_support_finds(self, seed: int) -> None:
        """The fast method against the exhaustive one, on problems whose unconstrained optimum
        has negative parts, columns of very different sizes, 1-7 columns."""
        rng = np.random.default_rng(seed)
        n = 1 + seed % 7
        a = rng.uniform(-1.0, 3.0, size=(30, n)) * 10.0 ** rng.uniform(-3, 3, size=n)
        y = rng.normal(size=30) * 50.0
        x = nonnegative_lstsq(a, y)
        scale = np.abs(a).max(axis=0)
        best = every_support(a / scale, y) / scale
        assert min(x) >= 0
        assert np.sum((a @ x - y) ** 2) == pytest.approx(np.sum((a @ best - y) ** 2), rel=1e-9)

    @pytest.mark.parametrize("seed", range(40))
    def test_a_search_started_from_any_support_finds_the_same_optimum(self, seed: int) -> None:
        """The batch cost starts each fit where the last one ended; a wrong start (columns whose
        solution goes negative, or that miss the optimum's) must not change the answer."""
        rng = np.random.default_rng(100 + seed)
        n = 2 + seed % 6
        a = rng.uniform(-1.0, 3.0, size=(30, n)) * 10.0 ** rng.uniform(-3, 3, size=n)
        y = rng.normal(size=30) * 50.0
        cold = nonnegative_lstsq(a, y)
        for start in (cold > 0, ~(cold > 0), rng.uniform(size=n) < 0.5, np.ones(n, dtype=bool)):
            warm = nonnegative_lstsq(a, y, start)
            assert min(warm) >= 0
            assert np.sum((a @ warm - y) ** 2) == pytest.approx(np.sum((a @ cold - y) ** 2),
                                                                 rel=1e-9)

    def test_solver_matches_least_squares_when_that_is_non_negative(self) -> None:
        rng = np.random.default_rng(3)
        a = rng.uniform(0.5, 2.0, size=(12, 4))
        truth = np.array([3.0, 0.5, 2.0, 0.1])
        assert nonnegative_lstsq(a, a @ truth) == pytest.approx(truth)


class TestFitQuality:
    def test_exact_shape_has_small_error(self) -> None:
        fit = fitted(CPU, 80).describe()
        assert fit.median_error is not None and fit.median_error < 0.01
        assert (fit.samples, fit.in_fit) == (80, 48)

    def test_noise_shows_in_the_error(self) -> None:
        fit = fitted(CPU, 120, noise=0.3).describe()
        assert fit.median_error is not None and 0.05 < fit.median_error < 0.3

    def test_summary_names_the_coefficients_and_the_error(self) -> None:
        text = fitted(GPU).describe().summary()
        assert re.match(r"batch ≈ (19\.9|20\.0|20\.1) ms \+ 0\.00 ms per 1k ctx \+ 0\.020 ms/token",
                        text), text
        assert "ms/decoder" in text and "cells of others" in text
        assert "(fitted, 48 of 60 samples, median error 0%)" in text


class TestRegimeShift:
    def test_follows_a_busy_machine_within_three_observations(self) -> None:
        model = fitted(CPU, 40)
        for ctx in (1000, 2000, 3000):
            model.observe_piece(64, ctx, BUSY.batch_ms(64, ctx, 3), 3)
        fit = model.describe()
        assert (fit.shifts, fit.in_fit) == (1, 3)
        for ctx in (0, 2500, 5000):
            assert model.cost.batch_ms(64, ctx, 3) == pytest.approx(BUSY.batch_ms(64, ctx, 3), rel=0.1)

    def test_then_learns_the_new_shape_from_varied_samples(self) -> None:
        model = fitted(CPU, 40)
        feed(model, BUSY, 20, seed=2)
        assert worst_error(model, BUSY) < 0.02

    def test_and_back(self) -> None:
        model = fitted(BUSY, 40)
        feed(model, CPU, 20)
        assert model.describe().shifts == 1
        assert worst_error(model, CPU) < 0.02

    def test_one_fluke_is_no_shift_and_pulls_little(self) -> None:
        # a batch at a tenth of its time pulls like one a time too many, not like one ten times off.
        model = fitted(CPU, 40)
        model.observe_piece(512, 3000, CPU.batch_ms(512, 3000) / 10)
        feed(model, CPU, 2)
        assert model.describe().shifts == 0
        assert worst_error(model, CPU) < 0.15

    def test_noise_is_no_shift(self) -> None:
        fit = fitted(CPU, 200, noise=0.3, seed=5).describe()
        assert fit.shifts == 0


class TestIgnored:
    @pytest.mark.parametrize("elapsed", [0.0, -5.0, math.nan, math.inf])
    def test_bad_times_are_counted_not_learned(self, elapsed: float) -> None:
        model = BatchCostModel()
        model.observe_piece(64, 0, elapsed)
        model.observe_prefill(3000, 0, elapsed, 2048)
        assert model.cost == PRIOR
        assert (model.describe().ignored, model.describe().samples) == (2, 0)

    def test_no_tokens_is_ignored(self) -> None:
        model = BatchCostModel()
        model.observe_piece(0, 0, 50.0)
        model.observe_prefill(0, 100, 50.0, 2048)
        assert model.describe().ignored == 2

    def test_bad_settings_are_errors(self) -> None:
        with pytest.raises(ValueError, match="forgetting"):
            BatchCostModel(forgetting=0.0)
        with pytest.raises(ValueError, match="fixed_ms > 0"):
            BatchCostModel(BatchCost(0.0, 1.0, 0.0, 0.0))


class TestProbe:
    def test_a_run_of_one_size_asks_for_a_probe(self) -> None:
        model = BatchCostModel()
        for i in range(11):
            model.observe_piece(64, 64 * i, CPU.batch_ms(64, 64 * i, 1), 1)
        assert not model.needs_probe()
        model.observe_piece(64, 704, CPU.batch_ms(64, 704, 1), 1)
        assert model.needs_probe()

    def test_one_other_size_in_the_run_is_enough(self) -> None:
        model = BatchCostModel()
        for i in range(12):
            n = 128 if i == 5 else 64
            model.observe_piece(n, 64 * i, CPU.batch_ms(n, 64 * i, 1), 1)
        assert not model.needs_probe()

    def test_the_probe_tells_the_fixed_part_from_the_per_token_part(self) -> None:
        # 64-token pieces only: growing with the prefix, their time could be context read or attention;
        # a 128-token piece every twelve (as `needs_probe` asks) and the fit finds the 128-token cost.
        alike, probed = BatchCostModel(), BatchCostModel()
        for i in range(24):
            ctx = 128 * i
            alike.observe_piece(64, ctx, CPU.batch_ms(64, ctx, 1), 1)
            n = 128 if i in (8, 16) else 64
            probed.observe_piece(n, ctx, CPU.batch_ms(n, ctx, 1), 1)
        truth = CPU.batch_ms(128, 3000, 1)
        assert abs(probed.cost.batch_ms(128, 3000, 1) / truth - 1) < 0.05
        assert abs(probed.cost.batch_ms(128, 3000, 1) / truth - 1) < abs(
            alike.cost.batch_ms(128, 3000, 1) / truth - 1)
