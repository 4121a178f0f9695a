"""What a finished request's prefill teaches the prefill policy (its rules 9 and 19): the batch
cost, if it computed LEARN_MIN_TOKENS or more and its last micro-batch was a whole tile; else the
row-by-row price (trims.py). Pure; `PrefillPolicy.on_finished` calls it.
"""

from __future__ import annotations

from proxy.prefill.narrow import last_rows
from proxy.prefill.policy_state import PolicyState
from proxy.prefill.sizing import TILE_ROWS

LEARN_MIN_TOKENS = 256
"""A finished request teaches the batch cost only if it computed at least this many tokens. Short
turns are left out: their prompt time is mostly per-request work, and with one shared KV they attend
over other slots' cells the model does not see, so they read as a much cheaper machine than the
one a piece meets (seen: pieces predicted at 85 ms that took 240)."""


def learn_prefill(st: PolicyState, req_id: str, prompt_n: int, prompt_ms: float,
                  cache_n: int) -> None:
    """`req_id` computed `prompt_n` tokens after `cache_n` cached in `prompt_ms`, beside the
    others in flight."""
    decoders, cells = st.use.decoders(besides=req_id), st.use.cells(besides=req_id)
    if prompt_n >= LEARN_MIN_TOKENS:
        ub = min(st.n_batch, st.cfg.n_ubatch)
        if ub < TILE_ROWS or last_rows(prompt_n, decoders, st.shared_kv, st.n_batch,
                                       ub) >= TILE_ROWS:  # rule 19: a short last one is not tiled
            st.cost.observe_prefill(prompt_n, cache_n, prompt_ms, st.n_batch, decoders, cells)
    else:  # rule 19
        st.trims.learn(st.cost, prompt_n, cache_n, prompt_ms, decoders, cells, st.shared_kv)
