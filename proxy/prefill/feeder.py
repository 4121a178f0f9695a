"""Sends one piece of a cold prompt upstream: a token-id prefix to `/completion` with `n_predict: 0`.

Never pinned with `id_slot` (a pinned piece to an emptied slot gets no RAM-cache restore). The one
sampled token is discarded; only `timings` come back. Cancelling the call closes its connection.

A piece whose `lora` is the list the server's global scales are kept at (`global_lora`: the LoRA
profile in modes fixed and none, proxy/ops/lora_watch.py) goes without it. llama-server clears a
slot's cache for a task whose explicit `lora` differs from the slot's last one, and a slot that
never had a task counts as different: with one shared KV every idle slot is emptied into the RAM
cache at each task launch, the next piece is put into a slot never used yet and has its prefix
copied back from RAM, and an explicit `lora` then wiped it (bench day, every run: ann's
1,998-token first turn computed 2,688-3,392 tokens). Without `lora` the slot takes the global
list, which the real request's explicit profile equals: nothing is cleared, and the KV is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.prefill.pieces import PIECE_PATH, piece_body
from proxy.upstream import UpstreamCallError, UpstreamClient


class PieceError(Exception):
    """The piece did not extend the server's cache; the message says why (fail open)."""


@dataclass(frozen=True)
class PieceResult:
    prompt_n: int
    """Tokens the server computed for this piece."""
    cache_n: int
    """Tokens it found cached (the previous pieces, when all went well)."""
    elapsed_ms: float
    """Wall time from sending the piece to its answer."""
    prompt_ms: float | None = None
    """The server's `timings.prompt_ms`: the piece's batch, without the wait before it."""

    @property
    def batch_ms(self) -> float:
        """The piece's batch time as best known (what the streams stalled for). Not the wall time:
        a piece sent while every slot is busy waits in the server's queue first, and a model fed
        that wait (seen: 64-token pieces "costing" 800 ms on four busy slots) sizes pieces for
        a slower machine than the one there is."""
        return self.prompt_ms if self.prompt_ms is not None else self.elapsed_ms


class PieceFeeder:
    """Posts pieces through slotwise's one upstream client."""

    def __init__(self, upstream: UpstreamClient, *, timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic,
                 global_lora: Callable[[], Any] = lambda: None) -> None:
        self._upstream = upstream
        self._timeout_s = timeout_s
        self._clock = clock
        self._global_lora = global_lora

    async def feed(self, ids: Sequence[int], upto: int, lora: Any) -> PieceResult:
        sent = lora if isinstance(lora, list) and lora != self._global_lora() else None
        body = piece_body(ids, upto, lora=sent)
        start = self._clock()
        try:
            answer = await self._upstream.post_json(PIECE_PATH, body, timeout_s=self._timeout_s)
        except UpstreamCallError as exc:
            raise PieceError(f"piece to {upto} tokens: {exc}") from exc
        return _result(answer, upto, (self._clock() - start) * 1000.0)


def _result(answer: Any, upto: int, elapsed_ms: float) -> PieceResult:
    timings = answer.get("timings") if isinstance(answer, dict) else None
    prompt_n = timings.get("prompt_n") if isinstance(timings, dict) else None
    cache_n = timings.get("cache_n") if isinstance(timings, dict) else None
    if not isinstance(prompt_n, int) or not isinstance(cache_n, int):
        raise PieceError(f"piece to {upto} tokens: the answer has no timings.prompt_n/cache_n")
    prompt_ms = timings.get("prompt_ms") if isinstance(timings, dict) else None
    return PieceResult(prompt_n=prompt_n, cache_n=cache_n, elapsed_ms=elapsed_ms,
                       prompt_ms=float(prompt_ms) if isinstance(prompt_ms, int | float) else None)
