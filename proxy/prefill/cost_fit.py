"""Learning what a batch costs from the server's own batches: `BatchCostModel` fits the form of
`batch_cost.py` online. Pure: observations in, predictions out; no clock, no I/O, no log.

The fit: non-negative least squares over the last `window` observations, each weighted by
`forgetting`**age and its error measured relative to its time (a 2 s batch and a 20 ms one count
alike; see `Sample.scale`). The prior enters as a few imagined batches of small weight (each 3 % of
the newest sample: at 1 %, two noisy first pieces once made the fit guess a context read ten times
too large), scaled first to the samples' level (a busy machine is slower at everything): where the
samples do not tell the coefficients apart (every piece the same size, say) the fit keeps the
prior's proportions, and with no sample it is the prior.
When `shift_run` observations in a row come out more than `shift_ratio` times off the prediction, all
in the same direction, the machine has changed (another process took the cores): the older samples are
dropped, so the model follows within that many observations.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

import numpy as np
import numpy.typing as npt

from proxy.prefill.batch_cost import PRIOR, PRIOR_SHAPES, BatchCost, Row, batch_row, prompt_row
from proxy.prefill.nnls import nonnegative_lstsq


@dataclass(frozen=True)
class Sample:
    row: Row
    ms: float
    scale: float
    """Its error counts relative to this: the larger of the time observed and the time predicted
    when it came, so a sample far below the prediction (a fluke, or a change not yet confirmed)
    pulls no harder than one far above it."""
    prior_ms: float
    """What the prior predicts for its row (the samples' level against the prior, at every fit)."""


@dataclass(frozen=True)
class CostFit:
    """The model as it stands, for a status page, `/metrics` and the log."""

    cost: BatchCost
    source: str
    """`prior` (nothing measured yet, or everything dropped) or `fitted`."""
    samples: int
    """Observations accepted since the start, with those kept from before it (`adopt`)."""
    in_fit: int
    """Observations the current fit is made of (the window, after any shift)."""
    ignored: int
    """Observations refused (no tokens, no time, not a number)."""
    shifts: int
    """Times the machine was seen to change and older samples were dropped."""
    median_error: float | None
    """Median of |observed / predicted - 1| over recent observations, each predicted before it was
    seen (None before the first)."""

    def summary(self) -> str:
        c = self.cost
        err = "no error yet" if self.median_error is None else f"median error {self.median_error:.0%}"
        return (f"batch ≈ {c.fixed_ms:.1f} ms + {c.per_kctx_ms:.2f} ms per 1k ctx"
                f" + {c.per_token_ms:.3f} ms/token"
                f" + {c.per_token_per_kctx_ms:.3f} ms/token per 1k ctx + {c.per_decoder_ms:.2f} ms/decoder"
                f" + {c.per_token_per_kcells_ms:.3f} ms/token and {c.per_kcells_ms:.2f} ms per 1k"
                " cells of others"
                f" ({self.source}, {self.in_fit} of {self.samples} samples, {err})")


class BatchCostModel:
    """The fitted batch cost; `observe_*` learn, `cost` predicts, `describe` reports."""

    def __init__(self, prior: BatchCost = PRIOR, *, window: int = 48, forgetting: float = 0.97,
                 prior_weight: float = 0.03, shift_run: int = 3, shift_ratio: float = 2.0,
                 error_window: int = 32) -> None:
        if window < shift_run or shift_run < 1 or not 0 < forgetting <= 1:
            raise ValueError(f"need window >= shift_run >= 1 and 0 < forgetting <= 1, got "
                             f"{window}, {shift_run}, {forgetting}")
        if min(prior.as_tuple()) < 0 or prior.fixed_ms <= 0 or prior_weight <= 0 or shift_ratio <= 1:
            raise ValueError("need a non-negative prior with fixed_ms > 0, prior_weight > 0 and "
                             "shift_ratio > 1")
        self._prior = prior
        self._forgetting, self._prior_weight = forgetting, prior_weight
        self._shift_run, self._shift_ratio = shift_run, shift_ratio
        self._samples: deque[Sample] = deque(maxlen=window)
        self._ratios: deque[float] = deque(maxlen=shift_run)
        self._errors: deque[float] = deque(maxlen=error_window)
        self._cost = prior
        self._support: npt.NDArray[np.bool_] | None = None
        """The columns the last fit used: the next one starts its search there."""
        self._accepted = self._ignored = self._shifts = 0

    @property
    def cost(self) -> BatchCost:
        return self._cost

    @property
    def measured(self) -> bool:
        """Whether the cost stands on observations of this server (else on the prior alone)."""
        return bool(self._samples)

    def observe_piece(self, tokens: int, ctx: int, elapsed_ms: float, decoders: int = 0,
                      cells: int = 0) -> None:
        """A piece of `tokens` after `ctx` tokens in its slot took one batch of `elapsed_ms` (the
        server's `timings.prompt_ms` when known: wall time also counts the wait for a batch in flight)."""
        if tokens < 1 or ctx < 0 or decoders < 0 or cells < 0:
            self._ignored += 1
            return
        self._observe(batch_row(tokens, ctx, decoders, cells), elapsed_ms)

    def observe_prefill(self, prompt_n: int, cache_n: int, prompt_ms: float, n_batch: int,
                        decoders: int = 0, cells: int = 0) -> None:
        """A finished request computed `prompt_n` tokens after `cache_n` cached in `prompt_ms`
        (the server's timings), in batches of at most `n_batch`."""
        if prompt_n < 1 or cache_n < 0 or n_batch < 1 or decoders < 0 or cells < 0:
            self._ignored += 1
            return
        self._observe(prompt_row(prompt_n, cache_n, n_batch, decoders, cells), prompt_ms)

    @property
    def shifts(self) -> int:
        """Times the machine was seen to change (older samples dropped)."""
        return self._shifts

    def needs_probe(self, run: int = 12) -> bool:
        """Whether the last `run` observations were all batches of one size: then the samples cannot
        tell what a batch costs whatever its size from what each token costs (nor the context read
        from the attention), and a model fitted on them would take every piece as efficient as a
        whole prompt. The strategy then makes one piece larger, to measure."""
        recent = list(self._samples)[-run:]
        return len(recent) == run and len({s.row[1] for s in recent}) == 1

    def export(self) -> list[tuple[Row, float, float]]:
        """The samples the fit stands on, oldest first: each batch's row, its time and the scale
        its error counts relative to (what `adopt` takes back after a restart)."""
        return [(s.row, s.ms, s.scale) for s in self._samples]

    def adopt(self, samples: Sequence[tuple[Row, float, float]]) -> None:
        """Samples `export` gave (checked by the caller), as if observed before any since: the
        fit stands on them at once. Their errors and shifts are not replayed."""
        kept = list(self._samples)
        self._samples.clear()
        for row, ms, scale in [*samples, *((s.row, s.ms, s.scale) for s in kept)]:
            self._samples.append(Sample(row, ms, scale, self._prior.time_ms(row)))
        self._accepted += len(samples)
        if self._samples:
            self._cost = self._fit()

    def describe(self) -> CostFit:
        return CostFit(
            cost=self._cost, source="fitted" if self.measured else "prior",
            samples=self._accepted, in_fit=len(self._samples), ignored=self._ignored,
            shifts=self._shifts,
            median_error=median(abs(e) for e in self._errors) if self._errors else None)

    # ---- internals -------------------------------------------------------------------------------

    def _observe(self, row: Row, elapsed_ms: float) -> None:
        if not math.isfinite(elapsed_ms) or elapsed_ms <= 0:
            self._ignored += 1
            return
        predicted = max(self._cost.time_ms(row), 1e-9)
        ratio = elapsed_ms / predicted
        self._errors.append(ratio - 1.0)
        self._ratios.append(ratio)
        prior_ms = self._prior.time_ms(row)
        sample = Sample(row, elapsed_ms, max(elapsed_ms, predicted), prior_ms)
        if self._shifted():
            self._forget_before_shift()
            sample = Sample(row, elapsed_ms, elapsed_ms, prior_ms)
        self._samples.append(sample)
        self._accepted += 1
        self._cost = self._fit()

    def _shifted(self) -> bool:
        r = self._ratios
        return len(r) == r.maxlen and (min(r) > self._shift_ratio or max(r) < 1 / self._shift_ratio)

    def _forget_before_shift(self) -> None:
        """Keep only the samples of the run that showed the shift (its newest is added next); they
        are the new regime, so each is measured relative to itself from now on."""
        keep = list(self._samples)[-(self._shift_run - 1):] if self._shift_run > 1 else []
        self._samples.clear()
        self._samples.extend(Sample(s.row, s.ms, s.ms, s.prior_ms) for s in keep)
        self._ratios.clear()
        self._shifts += 1

    def _fit(self) -> BatchCost:
        rows, ys, weights = self._system()
        x = nonnegative_lstsq(rows * weights[:, None], ys * weights, self._support)
        self._support = x > 0
        a, b, c, e, g, h, i = (float(v) for v in x)
        return BatchCost(a, b, c, e, g, h, i)

    def _system(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """The weighted rows: the samples (the newest weighs 1) and the prior's batches, the prior
        scaled first to the samples' level (a busy machine is slower at everything)."""
        samples = list(self._samples)
        n = len(samples)
        level = median(s.ms / s.prior_ms for s in samples) if samples else 1.0
        prior_rows = [batch_row(*shape) for shape in PRIOR_SHAPES]
        prior_ys = [level * self._prior.time_ms(r) for r in prior_rows]
        rows = np.array([s.row for s in samples] + prior_rows, dtype=np.float64)
        ys = np.array([s.ms for s in samples] + prior_ys, dtype=np.float64)
        weights = np.array([self._forgetting ** (n - 1 - i) / s.scale for i, s in enumerate(samples)]
                           + [self._prior_weight / y for y in prior_ys], dtype=np.float64)
        return rows, ys, weights
