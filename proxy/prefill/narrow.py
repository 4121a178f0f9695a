"""Short turns and the row-by-row price (the prefill policy's rule 19): what a batch of fewer than
TILE_ROWS prompt tokens costs this server beyond the batch cost's tiled price, learned from the
requests that computed one, and where a short turn's trim piece ends when computing 64 of its
cached tokens again with it is cheaper than its own few.

ggml's CPU flash attention computes fewer than 64 query rows one at a time, each reading its whole
context: a follow-up turn of 54 new tokens after 3,093 cached took 877 ms on the testbed, where 81
after 3,070 took 327, and `dan-0`'s 58 tokens after a 6,016-token restore froze every stream 1.8 s
(`bench day`). A trim piece, the prompt's first `len - TILE_ROWS` ids, makes
llama-server keep only those of the slot's cells (it computes one token again to answer); the turn
then computes its last 64 tokens in one tile. On a GPU the learned price stays near zero and
nothing is trimmed.

What shares a short prompt's rows depends on the KV layout. One shared KV cuts the batch into
micro-batches in order (llama.cpp's `split_simple`): the decode tokens come first and ride in the
prompt's tile. A KV per slot cuts it by sequence (`split_equal`, sequential): each sequence's rows
are its own, and when the slot just below the prompt's decodes, the prompt's first token goes with
that decode token, in a micro-batch of one row per sequence. A 64-token batch then computes 63 rows
one at a time: after 6,000 cached, beside a stream in the slot below, 64 tokens took 1.84-1.91 s
and 65 took 0.29-0.31 s (`-np 5 --no-cache-idle-slots`, testbed model; on one shared KV beside a
stream both took 0.31-0.33 s). So a trimmed turn computes one token more while anybody decodes.

A longer prompt sent whole ends the same way when its last micro-batch (llama-server's `-ub`, 512
by default) holds fewer than 64 rows: `bench day`'s post-summary rest of 559 new tokens beside
three streams on one shared KV ended in 50 rows and took 1.76-1.98 s (six runs), every stream
frozen for all of it, where 576 tokens took 1.0-1.2 s. Its trim computes again the cached tokens
that raise that micro-batch to a tile. Pure.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.sizing import TILE_ROWS

MIN_KCELLS = 20.0
"""A short prompt teaches the price only after this many thousand cell-reads (20 tokens after
1,000): with fewer its batch's fixed part is most of its time."""
MIN_SAMPLES = 3
KEEP = 16
"""The latest samples the price is the median of."""
TRIM_GAIN = 1.5
"""A turn is trimmed only if its own batch is predicted at least this many times the trimmed
way's (the step its trim piece rides in, then the 64-token tile): a guess must pay for itself
clearly. At 1.25 (`bench day`, report layout, 8dafe61) more turns were trimmed than at 1.5 with
the piece priced as its row alone (21-23 a day against 19-20), and the marginal ones did not pay:
`cho-5`, predicted at ~480-560 ms sent as it came, took 593-1,020 ms trimmed, its trim piece
181-523 ms (a launch on one shared KV also saves the idle slots to llama-server's RAM cache, which
no price here sees)."""
MIN_CACHED = 1000
"""Under this many cached tokens a short turn is cheap either way."""


def kcells(tokens: int, ctx: int) -> float:
    """Thousands of cells `tokens` new tokens after `ctx` cached read, all together."""
    return tokens * (ctx + tokens / 2) / 1000.0


@dataclass
class NarrowPrice:
    """The row-by-row price of this server, per prompt token per 1,000 tokens it attends to."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))

    def observe(self, tokens: int, ctx: int, ms: float, tiled_ms: float) -> None:
        """A finished request that computed `tokens` (with the decode tokens beside it, under
        TILE_ROWS rows) after `ctx` cached in `ms`, where the tiled batch cost says `tiled_ms`."""
        cells = kcells(tokens, ctx)
        if 0 < tokens < TILE_ROWS and cells >= MIN_KCELLS:
            self.samples.append((ms - tiled_ms) / cells)

    def adopt(self, samples: list[float]) -> None:
        """Samples kept from before a restart, oldest first, as if seen before any since."""
        now = list(self.samples)
        self.samples.clear()
        self.samples.extend([*samples, *now])

    def per_row_kctx_ms(self) -> float | None:
        """None until MIN_SAMPLES were seen; never below 0."""
        if len(self.samples) < MIN_SAMPLES:
            return None
        return max(0.0, statistics.median(self.samples))


def fewest_rows(tokens: int, decoders: int, shared_kv: bool | None) -> int:
    """The rows of the micro-batch a prompt of `tokens` computes in beside `decoders` decode
    tokens, at fewest: with all of them on one shared KV (or a layout not known); on a KV per slot
    its own, less the one that may go with the slot below's decode token."""
    if shared_kv is False:
        return tokens - (1 if decoders else 0)
    return tokens + decoders


class MicroBatch(NamedTuple):
    rows: int
    """All its rows, at fewest: the decode tokens' too when it shares theirs."""
    own: int
    """The prompt's own tokens among them."""
    whole: bool
    """The prompt's tokens all go in it (a short turn's)."""


def last_micro_batch(tokens: int, decoders: int, shared_kv: bool | None, n_batch: int,
                     n_ubatch: int) -> MicroBatch:
    """The last micro-batch a prompt of `tokens` new tokens computes in. llama-server puts the
    decode tokens first in every batch, then prompt tokens up to `n_batch`; llama.cpp cuts a batch
    into micro-batches of `n_ubatch` rows. A prompt that fits one micro-batch shares it
    (`fewest_rows`); a longer one ends in the rest of its last batch: 559 new tokens beside three
    streams on one shared KV end in 50 rows, computed one at a time (bench day: 1.76-1.98 s, where
    576 took 1.0-1.2)."""
    ub = max(1, min(n_batch, n_ubatch))
    room = max(1, n_batch - decoders)  # prompt tokens per batch
    last = tokens - (-(-tokens // room) - 1) * room  # the last batch's prompt tokens
    rows = fewest_rows(last, decoders, shared_kv)
    whole = last == tokens and rows <= ub
    if shared_kv is False:  # by sequence: one of them may go with the decode token below
        rows = rows if rows <= ub else rows % ub or ub
        return MicroBatch(rows, rows, whole)
    if rows <= ub:
        return MicroBatch(rows, last, whole)
    rows = rows % ub or ub  # the decode tokens went in the first one
    return MicroBatch(rows, rows, whole)


def last_rows(tokens: int, decoders: int, shared_kv: bool | None, n_batch: int,
              n_ubatch: int) -> int:
    """The rows of the last micro-batch a prompt of `tokens` new tokens computes in, at fewest."""
    return last_micro_batch(tokens, decoders, shared_kv, n_batch, n_ubatch).rows


@dataclass(frozen=True)
class Trim:
    upto: int
    """The trim piece's prefix: the prompt then computes its last `rows` tokens."""
    rows: int
    new_tokens: int
    tail: int
    """Its new tokens in the micro-batch that would go row by row (all of them: a short turn)."""
    own_ms: float
    """That micro-batch as it would go, row by row."""
    trimmed_ms: float
    """The trim piece and that micro-batch as a tile."""

    def reason(self) -> str:
        again = self.rows - self.new_tokens
        part = (f"its {self.new_tokens} new tokens" if self.tail >= self.new_tokens
                else f"the last {self.tail} of its {self.new_tokens:,} new tokens")
        return (f"trimmed: {part} would go row by row (~{self.own_ms:.0f} ms); {again} of its "
                f"cached tokens computed again with them, ~{self.trimmed_ms:.0f} ms")


def trim(cost: BatchCost, price: NarrowPrice, new_tokens: int, prompt_tokens: int,
         decoders: int, cells: int, shared_kv: bool | None = None, *, n_batch: int = 2048,
         n_ubatch: int = 512) -> Trim | None:
    """Rule 19: where a prompt's trim piece ends, or None when it does not pay (the server shows
    no row-by-row price, its last micro-batch reaches a tile (with the decode tokens beside it when
    it shares theirs), too little is cached, micro-batches are smaller than a tile anyway). The
    trim computes again as many of its cached tokens as give its last micro-batch a tile of its own
    tokens (and one more while anybody decodes: on a KV per slot its first token may go with the
    decode token of the slot below; on one shared KV a decoder may finish before the batch);
    what is compared, as the turn waits for them, is that micro-batch alone, row by row, against
    the step the trim piece rides in and the micro-batch as a tile (the full ones before it cost
    the same either way)."""
    r = price.per_row_kctx_ms()
    cached = prompt_tokens - new_tokens
    if (r is None or new_tokens <= 0 or min(n_batch, n_ubatch) < TILE_ROWS
            or cached < MIN_CACHED):
        return None
    last = last_micro_batch(new_tokens, decoders, shared_kv, n_batch, n_ubatch)
    if last.rows >= TILE_ROWS:
        return None
    alone = last.whole  # one micro-batch: a short turn
    tail = new_tokens if alone else last.own
    margin = 1 if decoders and shared_kv is not False else 0

    def tiled(n: int) -> bool:
        batch = last_micro_batch(n, decoders, shared_kv, n_batch, n_ubatch)
        return batch.rows >= TILE_ROWS and batch.own - margin >= TILE_ROWS

    rows = new_tokens
    while not tiled(rows) and rows - new_tokens <= 2 * TILE_ROWS:
        rows += 1
    again = rows - new_tokens
    if not tiled(rows) or again >= cached:
        return None
    ctx = cached + new_tokens - tail  # what the tail's tokens attend to
    upto = prompt_tokens - rows
    beside = decoders if alone else 0  # the decode tokens ride in a prompt's first micro-batch
    own = cost.batch_ms(tail, ctx, beside, cells) + r * kcells(tail, ctx)
    # the trim piece's one token is one more row of the decode step beside it (or a step of its
    # own), and the turn goes only after all of that step: its fixed part, the decoders' tokens
    # and the other slots' cells (bench day, three streams on one shared KV: trim pieces took
    # 200-250 ms where a row alone was priced at ~20, and `cho-5`'s 54 new tokens, predicted at
    # ~500 ms sent as they came, took 850-970 ms to her first token trimmed). Its one row is
    # priced by the row-by-row price: the batch cost, fitted on pieces of 64 tokens and more,
    # would price its context and cells as a tile's.
    piece = cost.batch_ms(0, 0, decoders, cells) + r * kcells(1, upto - 1)
    trimmed = piece + cost.batch_ms(tail + again, ctx - again, beside, cells)
    if own < TRIM_GAIN * trimmed:
        return None
    return Trim(upto, rows, new_tokens, tail, own, trimmed)
