"""What one batch of prompt tokens costs on this server: the form of the seven-coefficient model,
its prior, and the rows an observation makes (`cost_fit.py` fits it online). Pure arithmetic. The
strategy (`strategy.py`) sizes pieces with a `BatchCost`; the policy owns the only fitted model.

The form: a batch of n new tokens after a prefix of x tokens, with d other slots decoding and the
other requests in flight holding m cells (their prompts' tokens), takes

    t(n, x, d, m) = a + g·x/1000 + b·n + c·n·(x + n/2)/1000 + e·d + h·n·m/1000 + i·m/1000   (ms)

a: the fixed part (reading the weights, thread start-up); g: the part of the fixed part that grows
with the context, per 1,000 tokens (each batch reads the whole context's KV once, whatever its size);
b: per token (the matmuls); c: attention, per token per 1,000 tokens it attends to (token j of the
batch attends to x + j, n/2 on average); e: per decoding slot in the same batch. Why g: measured with
`slotwise bench pieces` (one stream, `-np 4` and `-np 4 -kvu`, pieces of 64-512 tokens after 300,
3,000 and 6,000 tokens), the time a batch takes whatever its size grew from ~10 ms after 300 tokens
to 60-70 ms after 3,000 and 80-130 ms after 6,000; without g, pieces measured at 64 tokens made
larger ones look dearer than they are, and small pieces at a long prefix cheaper.
A prompt of N tokens after x cached, computed in k = ceil(N / n_batch) batches of n_batch (the last
one the rest), takes k·(a + e·d) + g·(k·x + n_batch·k(k-1)/2)/1000 + b·N + c·N·(x + N/2)/1000: the
attention sum does not depend on how the prompt is cut, so a finished prefill is one linear
observation like a piece.
h, i: the other slots' cells in one shared KV (`-kvu`): each prompt token scans the mask over them,
and the decoders' tokens ride in a prompt's 64-row query tile over theirs (the what-if found
0.13-0.19 ms a token and 13-34 ms a micro-batch per 1,000 cells). Without them a 640-token piece
priced at 888 ms took 3.27 s beside three full streams (`bench day`). With a KV per slot the fit
keeps them near 0 (slotwise cannot tell the two layouts apart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Row = tuple[float, float, float, float, float, float, float]
"""One observation's features, in the order of the coefficients a, b, c, e, g, h, i."""


@dataclass(frozen=True)
class BatchCost:
    """The coefficients; all non-negative."""

    fixed_ms: float
    """a: per batch, whatever its size."""
    per_token_ms: float
    """b: per prompt token in the batch."""
    per_token_per_kctx_ms: float
    """c: per prompt token and per 1,000 tokens of context it attends to."""
    per_decoder_ms: float
    """e: per other slot decoding one token in the same batch."""
    per_kctx_ms: float = 0.0
    """g: per batch, per 1,000 tokens of context in the slot (read once by each batch)."""
    per_token_per_kcells_ms: float = 0.0
    """h: per prompt token, per 1,000 cells the other requests in flight hold (one shared KV)."""
    per_kcells_ms: float = 0.0
    """i: per batch, per 1,000 cells the other requests in flight hold (one shared KV)."""

    def batch_ms(self, tokens: int, ctx: int, decoders: int = 0, cells: int = 0) -> float:
        """One batch of `tokens` new tokens after `ctx` tokens already in the slot, beside
        `decoders` decoding slots and `cells` cells of other requests."""
        return self.time_ms(batch_row(tokens, ctx, decoders, cells))

    def prompt_ms(self, tokens: int, ctx: int, n_batch: int, decoders: int = 0,
                  cells: int = 0) -> float:
        """`tokens` new tokens after `ctx` cached, computed in batches of at most `n_batch`."""
        return self.time_ms(prompt_row(tokens, ctx, n_batch, decoders, cells))

    def as_tuple(self) -> Row:
        return (self.fixed_ms, self.per_token_ms, self.per_token_per_kctx_ms, self.per_decoder_ms,
                self.per_kctx_ms, self.per_token_per_kcells_ms, self.per_kcells_ms)

    def time_ms(self, row: Row) -> float:
        """The time of an observation with these features (`batch_row`, `prompt_row`)."""
        return sum(x * k for x, k in zip(row, self.as_tuple(), strict=True))


PRIOR = BatchCost(fixed_ms=20.0, per_token_ms=2.0, per_token_per_kctx_ms=0.0, per_decoder_ms=0.0)
"""Before any measurement: 64 tokens in ~150 ms, about the old default of 500 tokens/s."""

PRIOR_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (64, 0, 0, 0), (512, 0, 0, 0), (2048, 0, 0, 0), (512, 8192, 0, 0), (64, 8192, 0, 0),
    (64, 0, 8, 0), (64, 0, 0, 8192), (512, 0, 0, 8192))
"""The imagined batches (tokens, ctx, decoders, cells) that carry the prior: together they tell all
seven coefficients apart, so every fit has a single answer."""


def batch_row(tokens: int, ctx: int, decoders: int = 0, cells: int = 0) -> Row:
    return (1.0, float(tokens), tokens * (ctx + tokens / 2) / 1000.0, float(decoders), ctx / 1000.0,
            tokens * cells / 1000.0, cells / 1000.0)


def prompt_row(tokens: int, ctx: int, n_batch: int, decoders: int = 0, cells: int = 0) -> Row:
    step = max(1, n_batch)
    batches = max(1, math.ceil(tokens / step))
    read = batches * ctx + step * batches * (batches - 1) / 2
    return (float(batches), float(tokens), tokens * (ctx + tokens / 2) / 1000.0,
            float(batches * decoders), read / 1000.0, tokens * cells / 1000.0,
            batches * cells / 1000.0)
