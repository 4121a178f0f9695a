"""The body of one piece: a token-id prefix sent to `/completion` to extend the server's cache.

Pure. The piece must carry the same `lora` as the real request will (an explicit LoRA change
clears the slot's cache), and asks only for `timings` so the prompt text does not come back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PIECE_PATH = "/completion"


def piece_body(ids: Sequence[int], upto_tokens: int, *,
               lora: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`n_predict: 0` still samples one token (discard it); `timings.prompt_n` is what the piece
    computed and `timings.prompt_ms` its prefill time (for `PieceDone`)."""
    if not 0 < upto_tokens <= len(ids):
        raise ValueError(f"upto_tokens must be in 1..{len(ids)}, got {upto_tokens}")
    body: dict[str, Any] = {
        "prompt": list(ids[:upto_tokens]),
        "n_predict": 0,
        "stream": False,
        "cache_prompt": True,
        "response_fields": ["timings"],
    }
    if lora is not None:
        body["lora"] = lora
    return body
