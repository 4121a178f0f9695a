"""Pure rewrites of a request body: the LoRA profile, and the fields slotwise adds to measure.

Each rewrite takes the decoded body and returns a new one; the original is never changed, so the
handler can forward the client's own bytes whenever nothing was rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.record.clientstrings import clean_text
from proxy.record.kind import Kind

# Endpoints whose streams can carry `prompt_progress` chunks (llama-server's completion tasks).
_PROGRESS_KINDS = frozenset({Kind.CHAT, Kind.COMPLETIONS, Kind.COMPLETION, Kind.INFILL})


@dataclass(frozen=True)
class Rewritten:
    body: dict[str, Any]
    changed: bool
    lora_in: Any
    lora_out: Any
    lora_rewritten: bool
    progress_added: bool


def rewrite_body(kind: Kind, body: dict[str, Any], *,
                 forced_lora: list[dict[str, Any]] | None) -> Rewritten:
    """The body to forward.

    `forced_lora`: the explicit array every request must carry (LoRA mode fixed or none), or None to
    forward what the client sent. A stream gets `return_progress` so that the end of its prefill is
    seen exactly; the relay then drops those chunks again unless the client asked for them itself.
    """
    new = dict(body)
    lora_in = body.get("lora")
    lora_rewritten = forced_lora is not None and lora_in != forced_lora
    if lora_rewritten:
        new["lora"] = forced_lora
    progress_added = (kind in _PROGRESS_KINDS and body.get("stream") is True
                      and body.get("return_progress") is not True)
    if progress_added:
        new["return_progress"] = True
    return Rewritten(
        body=new,
        changed=lora_rewritten or progress_added,
        lora_in=lora_in,
        lora_out=new.get("lora"),
        lora_rewritten=lora_rewritten,
        progress_added=progress_added,
    )


def client_key(body: dict[str, Any], header: str | None, kind: Kind | None = None) -> str | None:
    """Who the request is for: the `X-Slotwise-Client` header (already cleaned), else, in an
    Anthropic Messages body, its `metadata.user_id` (that API's `user`), else the body's `user`;
    capped and made printable like the header."""
    if header:
        return header
    metadata = body.get("metadata") if kind is Kind.MESSAGES else None
    named = clean_text(metadata.get("user_id")) if isinstance(metadata, dict) else None
    return named or clean_text(body.get("user"))
