"""When a request under `cold_tokens` is cold all the same (rule 1 of `PrefillPolicy`): while
others generate, by how long sending it whole would stall the streams (sooner for a background
job's). Pure: numbers in, a reason out.
"""

from __future__ import annotations

from proxy.config import PrefillConfig
from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.events import Arrived

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


def stall_reason(cfg: PrefillConfig, model: BatchCostModel, req: Arrived, n_batch: int,
                 decoders: int, cells: int = 0, background: bool = False) -> str | None:
    """Why `req`, under `cold_tokens`, is cold all the same, or None when it is not. `decoders`:
    the requests generating now; `cells`: what the requests in flight hold; `background`: judged
    a background job (the policy's rule 1). The stall is judged only once the batch cost has
    measured this server: its prior is a guess."""
    stalls, least = ((BACKGROUND_STALLS, MIN_BACKGROUND_TOKENS) if background
                     else (WHOLE_STALLS, MIN_PIECED_TOKENS))
    if cfg.mode != "chunk" or decoders == 0 or req.est_new_tokens < least or not model.measured:
        return None
    stall_ms = whole_stall_ms(model.cost, req, n_batch, decoders, cells)
    if stall_ms <= stalls * cfg.max_stall_ms:
        return None
    job = "a background job: " if background else ""
    return (f"cold: {job}sent whole, its {req.est_new_tokens:,} new tokens would stall {decoders} "
            f"generating for ~{stall_ms / 1000.0:.1f} s (over {stalls:g} × max_stall_ms)")


def whole_stall_ms(cost: BatchCost, req: Arrived, n_batch: int, decoders: int,
                   cells: int = 0) -> float:
    """The longest batch of `req`'s new tokens sent whole beside `decoders` streams: what each
    of them waits for its next token."""
    cached = max(0, req.est_prompt_tokens - req.est_new_tokens)
    return cost.batch_ms(min(req.est_new_tokens, max(1, n_batch)), cached, decoders, cells)
