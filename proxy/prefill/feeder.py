"""Sends one piece of a cold prompt upstream: a token-id prefix to `/completion` with `n_predict: 0`.

Never pinned with `id_slot` (a pinned piece to an emptied slot gets no RAM-cache restore). The one
sampled token is discarded; only `timings` come back. Cancelling the call closes its connection.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.prefill.pieces import PIECE_PATH, piece_body
from proxy.upstream_call import send


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


class PieceFeeder:
    """Posts pieces through the proxy's one session."""

    def __init__(self, session: aiohttp.ClientSession, base_url: Callable[[], str], *,
                 headers: Callable[[], Mapping[str, str]] = dict,
                 timeout_s: float = 120.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._session = session
        self._base_url = base_url
        self._headers = headers
        """slotwise's own headers (the API key), read per piece so a reload applies."""
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock

    async def feed(self, ids: Sequence[int], upto: int, lora: Any) -> PieceResult:
        body = piece_body(ids, upto, lora=lora if isinstance(lora, list) else None)
        url = self._base_url().rstrip("/") + PIECE_PATH
        start = self._clock()
        try:
            async with await send(
                    self._session, "POST", url, data=orjson.dumps(body), timeout=self._timeout,
                    headers={**self._headers(), "Content-Type": "application/json",
                             "Accept-Encoding": "identity"}) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PieceError(f"piece to {upto} tokens: {type(exc).__name__}: {exc}") from exc
        elapsed_ms = (self._clock() - start) * 1000.0
        if status != 200:
            raise PieceError(f"piece to {upto} tokens: HTTP {status}: "
                             f"{raw[:200].decode(errors='replace')}")
        return _result(raw, upto, elapsed_ms)


def _result(raw: bytes, upto: int, elapsed_ms: float) -> PieceResult:
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise PieceError(f"piece to {upto} tokens: the answer is not JSON") from exc
    timings = answer.get("timings") if isinstance(answer, dict) else None
    prompt_n = timings.get("prompt_n") if isinstance(timings, dict) else None
    cache_n = timings.get("cache_n") if isinstance(timings, dict) else None
    if not isinstance(prompt_n, int) or not isinstance(cache_n, int):
        raise PieceError(f"piece to {upto} tokens: the answer has no timings.prompt_n/cache_n")
    return PieceResult(prompt_n=prompt_n, cache_n=cache_n, elapsed_ms=elapsed_ms)
