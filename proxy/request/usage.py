"""What a response's `usage` says about its prompt, in each API's own terms: the prompt's total
tokens and the tokens the server computed (not found in its cache). Pure.

OpenAI chat and completions: `prompt_tokens` is the total, `prompt_tokens_details.cached_tokens`
the cached part. OpenAI responses: `input_tokens` and `input_tokens_details`, the same way (a
stream carries it in `response.completed.response.usage`).
Anthropic messages: `input_tokens` counts only what was computed; `cache_read_input_tokens` (and
`cache_creation_input_tokens`) come on top; a stream carries it in `message_start.message.usage`.
"""

from __future__ import annotations

from typing import Any

from proxy.record.kind import Kind

NESTED = {Kind.MESSAGES: "message", Kind.RESPONSES: "response"}
"""Where a stream of these kinds carries its usage: `message_start.message.usage`,
`response.completed.response.usage`."""


def prompt_counts(kind: Kind, obj: dict[str, Any]) -> tuple[int | None, int | None]:
    """(total prompt tokens, tokens computed) from the usage a response or event carries."""
    usage = obj.get("usage")
    if not isinstance(usage, dict) and kind in NESTED:
        inner = obj.get(NESTED[kind])
        usage = inner.get("usage") if isinstance(inner, dict) else None
    if not isinstance(usage, dict):
        return None, None
    if kind is Kind.MESSAGES:
        computed = _count(usage.get("input_tokens"))
        if computed is None:
            return None, None
        computed += _count(usage.get("cache_creation_input_tokens")) or 0
        return computed + (_count(usage.get("cache_read_input_tokens")) or 0), computed
    total = _count(usage.get("prompt_tokens", usage.get("input_tokens")))
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    return total, None if total is None or cached is None else total - cached


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
