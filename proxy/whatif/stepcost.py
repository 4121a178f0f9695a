"""How long one batch of the server model takes, from the `Costs`: prompt tokens in micro-batches of
`n_ubatch` (with one shared KV the decode tokens share the first; with a KV per slot they get one
of their own, llama.cpp's split_equal, with the first token of a prompt whose slot is just above a
decoding one's), or a step of decode tokens only. Pure arithmetic.

Every token attends to its own slot's cells. With one shared KV its attention still runs over
every cell up to the highest in use (kvcells.py), reading the mask of those it skips: a decode
step pays for the cells of that span beyond each decode token's own (`decode_per_kv_ms`), a prompt
token likewise (`per_token_per_kv_ms`), and decode tokens in a prompt's micro-batch are computed in its
64-row query tiles. A micro-batch of fewer rows is computed one row at a time, each prompt token
reading its own cells (`narrow_per_row_kctx_ms`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from proxy.prefill.narrow import kcells
from proxy.prefill.sizing import TILE_ROWS
from proxy.whatif.costs import Costs


@dataclass(frozen=True, slots=True)
class PromptRun:
    """One slot's prompt tokens in a batch."""

    tokens: int
    ctx: int
    """Cells the first of them attends to before itself: the slot's own tokens."""
    others: int = 0
    """Cells of one shared KV's span beyond its own (masked from it, but scanned: kvcells.py)."""
    chained: bool = False
    """A KV per slot, the slot just below decoding: split_equal (sequential) puts this run's first
    token in the decode tokens' micro-batch, one row per sequence, and the rest after it."""

    @property
    def own_rows(self) -> int:
        """Its tokens in micro-batches of its own."""
        return self.tokens - (1 if self.chained and self.tokens > 1 else 0)


def batch_ms(costs: Costs, decode_ctx: Sequence[int], runs: Sequence[PromptRun], *,
             n_ubatch: int, unified: bool, scanned: int = 0) -> float:
    """One batch: `decode_ctx` holds the cells each decode token attends to; `scanned`, the cells
    of one shared KV's span they read beyond those, all together (a decode-only step's)."""
    decoders = len(decode_ctx)
    attended = costs.decode_per_kctx_ms * sum(decode_ctx) / 1000.0
    if not runs:
        return (costs.step_ms + costs.per_slot_ms * max(0, decoders - 1) + attended
                + costs.decode_per_kv_ms * scanned / 1000.0)
    ub = max(1, n_ubatch)
    prompt = sum(r.tokens for r in runs)
    if unified:
        micro = math.ceil((decoders + prompt) / ub)
    else:
        micro = (1 if decoders else 0) + sum(math.ceil(r.own_rows / ub) for r in runs)
    ms = costs.fixed_ms * micro + costs.per_decoder_ms * decoders + attended
    if unified and min(ub, decoders + prompt) >= TILE_ROWS:
        # the decode tokens ride in the prompt's first micro-batch, in its query tiles (fewer
        # rows go one at a time, as in a decode step: `attended` prices them)
        ms += costs.per_decoder_kctx_ms * sum(decode_ctx) / 1000.0
    for run in runs:
        k = math.ceil(run.tokens / ub)
        read = k * run.ctx + ub * k * (k - 1) / 2
        ms += (costs.per_token_ms * run.tokens
               + costs.per_token_per_kctx_ms * run.tokens * (run.ctx + run.tokens / 2) / 1000.0
               + costs.per_kctx_ms * read / 1000.0
               + costs.per_token_per_kv_ms * run.tokens * run.others / 1000.0)
    if costs.narrow_per_row_kctx_ms:
        ms += costs.narrow_per_row_kctx_ms * narrow_kcells(decoders, runs, ub, unified)
    return ms


def narrow_kcells(decoders: int, runs: Sequence[PromptRun], n_ubatch: int, unified: bool) -> float:
    """Thousands of cells the prompt tokens of micro-batches under TILE_ROWS rows attend to, all
    together: the last micro-batch of each run (a KV per slot: llama.cpp's split_equal gives each
    sequence its own, after the token a chained run gives the decode tokens' micro-batch), or of the
    batch (one shared KV: decode tokens first, then the runs in order, cut every `n_ubatch` rows);
    ggml's CPU flash attention computes those rows one at a time."""
    ub = max(1, n_ubatch)
    if not unified:
        total = 0.0
        for run in runs:
            last = run.own_rows - (math.ceil(run.own_rows / ub) - 1) * ub
            if 0 < last < TILE_ROWS:
                total += kcells(last, run.ctx + run.tokens - last)
        return total
    rows = decoders + sum(r.tokens for r in runs)
    last = rows - (math.ceil(rows / ub) - 1) * ub
    if not runs or last >= TILE_ROWS:
        return 0.0
    total, left = 0.0, last  # the batch's last `last` rows: the runs' tails, the last run first
    for run in reversed(runs):
        n = min(left, run.tokens)
        total += kcells(n, run.ctx + run.tokens - n)
        left -= n
        if left <= 0:
            break
    return total


def decode_steps_ms(costs: Costs, decoders: int, attended: int, growth: int,
                    steps: int, scanned: int = 0) -> npt.NDArray[np.float64]:
    """The times of `steps` decode-only steps in a row: the first with `attended` cells attended
    in all, each next one with `growth` more; `scanned` read beyond them in each (held: the span
    moves little in a stretch)."""
    k = np.arange(steps, dtype=np.float64)
    base = (costs.step_ms + costs.per_slot_ms * max(0, decoders - 1)
            + costs.decode_per_kv_ms * scanned / 1000.0)
    result: npt.NDArray[np.float64] = base + costs.decode_per_kctx_ms * (attended + k * growth) / 1000.0
    return result


def prompt_alone_ms(costs: Costs, tokens: int, ctx: int, *, n_batch: int, n_ubatch: int,
                    unified: bool) -> float:
    """A prompt of `tokens` after `ctx` cached, alone on the server: batches of `n_batch`."""
    ms, done = 0.0, 0
    while done < tokens:
        n = min(max(1, n_batch), tokens - done)
        ms += batch_ms(costs, (), (PromptRun(n, ctx + done),), n_ubatch=n_ubatch, unified=unified)
        done += n
    return ms
