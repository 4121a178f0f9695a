"""When a request under `cold_tokens` is cold all the same (rule 1 of `PrefillPolicy`): while
others generate, by how long sending it whole would stall the streams (sooner for a background
job's); and when a chat turn not cold so is split in pieces back to back all the same. Pure:
numbers in, a reason out.
"""

from __future__ import annotations

from proxy.config import PrefillConfig
from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.events import Arrived
from proxy.prefill.sizing import PIECE_ALIGN
from proxy.prefill.strategy import STALL_SLACK

WHOLE_STALLS = 8.0
"""A request under `cold_tokens` is cold all the same when, sent whole beside the streams, its
batch is predicted to stall them longer than this × `max_stall_ms`. Seen in `bench day` (one shared
KV, four streams, this CPU): a post-summary rest of 1,198-1,389 tokens, warmed to under
`cold_tokens`, went whole and froze every stream for 5.8-6.9 s, the day's longest gap; short turns
of 130-300 tokens froze them 1.4-3.4 s, the day's next longest, at under this × 160 ms."""

MIN_PIECED_TOKENS = 512
"""...but only from this many new tokens (llama-server's default micro-batch): cut smaller, a
prompt is a short turn's, and its own first token would pay one pause or more per piece for a
stall the streams already take from every short turn of the day."""
BACKGROUND_STALLS = 2.0
"""A background job (`prefill.background_purposes`) is cold from this × `max_stall_ms` (the
streams' longest gap `chunk` promises): nobody reads it as it comes, and sent whole beside the
streams a 600-token translation froze them 1.5-1.9 s in `bench day`..."""
MIN_BACKGROUND_TOKENS = 128
"""...and this many new tokens (two pieces of the smallest size)."""
SPLIT_SLACK_MS = 100.0
"""A chat turn is split (`split_reason`) when, sent whole, it would stall the streams over
STALL_SLACK × `max_stall_ms` + this: the streams' longest gap as the promise states it. Under it
a split gains the streams less than its pieces cost the turn (the what-if on eighteen `bench day`
days: 239 tokens stalling ~0.4 s went in two pieces, +90-130 ms to the turn's first token)."""
MIN_SPLIT_TOKENS = 2 * PIECE_ALIGN
"""A chat turn is split (`split_reason`) from this many new tokens: two pieces of the smallest
size. Its pieces go back to back, so a short one pays no pause, only their fixed parts (the
strategy's rule 9 bounds them)."""


def stall_reason(cfg: PrefillConfig, model: BatchCostModel, req: Arrived, n_batch: int,
                 decoders: int, cells: int = 0, background: bool = False) -> str | None:
    """Why `req`, under `cold_tokens`, is cold all the same, or None when it is not. `decoders`:
    the requests generating now; `cells`: what the requests in flight hold; `background`: judged
    a background job (the policy's rule 1). The stall is judged only once the batch cost has
    measured this server: its prior is a guess."""
    stalls, least = ((BACKGROUND_STALLS, MIN_BACKGROUND_TOKENS) if background
                     else (WHOLE_STALLS, MIN_PIECED_TOKENS))
    said = _stalls(cfg, model, req, n_batch, decoders, cells, least, stalls * cfg.max_stall_ms,
                   f"{stalls:g} × max_stall_ms")
    return None if said is None else f"cold: {'a background job: ' if background else ''}{said}"


def split_reason(cfg: PrefillConfig, model: BatchCostModel, req: Arrived, n_batch: int,
                 decoders: int, cells: int = 0) -> str | None:
    """Why a chat turn under `cold_tokens`, not cold by its stall (`stall_reason`), goes in pieces
    back to back all the same (the strategy's `split_piece`), or None: sent whole, its batch would
    stall the streams beyond their promise, STALL_SLACK × `max_stall_ms` + SPLIT_SLACK_MS (bench
    day, `-np 5`: `ann-5`'s 495-687 tokens left by her warm-up froze every stream 0.9-1.4 s, the
    day's longest gap)."""
    said = _stalls(cfg, model, req, n_batch, decoders, cells, MIN_SPLIT_TOKENS,
                   STALL_SLACK * cfg.max_stall_ms + SPLIT_SLACK_MS,
                   f"{STALL_SLACK:g} × max_stall_ms + {SPLIT_SLACK_MS / 1000.0:g} s")
    return None if said is None else f"split: {said}"


def _stalls(cfg: PrefillConfig, model: BatchCostModel, req: Arrived, n_batch: int, decoders: int,
            cells: int, least: int, over_ms: float, over: str) -> str | None:
    """How long `req` sent whole would stall the streams, said, when over `over_ms` (`over` says
    it) and it has `least` new tokens or more; else None."""
    if cfg.mode != "chunk" or decoders == 0 or req.est_new_tokens < least or not model.measured:
        return None
    stall_ms = whole_stall_ms(model.cost, req, n_batch, decoders, cells)
    if stall_ms <= over_ms:
        return None
    return (f"sent whole, its {req.est_new_tokens:,} new tokens would stall {decoders} "
            f"generating for ~{stall_ms / 1000.0:.1f} s (over {over})")


def whole_stall_ms(cost: BatchCost, req: Arrived, n_batch: int, decoders: int,
                   cells: int = 0) -> float:
    """The longest batch of `req`'s new tokens sent whole beside `decoders` streams: what each
    of them waits for its next token."""
    cached = max(0, req.est_prompt_tokens - req.est_new_tokens)
    return cost.batch_ms(min(req.est_new_tokens, max(1, n_batch)), cached, decoders, cells)
