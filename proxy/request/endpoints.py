"""Which endpoint a request is for, and what slotwise must do with it.

Only requests that run the model are read and measured in detail; everything else (`/health`,
`/props`, `/slots`, `/tokenize`, …) is relayed as it comes, body streamed.
"""

from __future__ import annotations

import enum


class Kind(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"  # OpenAI /v1/completions
    COMPLETION = "completion"  # llama.cpp native /completion
    INFILL = "infill"
    MESSAGES = "messages"  # Anthropic-style /v1/messages
    RESPONSES = "responses"  # OpenAI /v1/responses
    EMBEDDINGS = "embeddings"
    OTHER = "other"


_MODEL_PATHS: dict[str, Kind] = {
    "/chat/completions": Kind.CHAT,
    "/v1/chat/completions": Kind.CHAT,
    "/completions": Kind.COMPLETIONS,
    "/v1/completions": Kind.COMPLETIONS,
    "/completion": Kind.COMPLETION,
    "/infill": Kind.INFILL,
    "/v1/messages": Kind.MESSAGES,
    "/v1/responses": Kind.RESPONSES,
    "/embedding": Kind.EMBEDDINGS,
    "/embeddings": Kind.EMBEDDINGS,
    "/v1/embeddings": Kind.EMBEDDINGS,
}

# Kinds whose tasks generate text, take `lora`, and stream token events.
GENERATING = frozenset(
    {Kind.CHAT, Kind.COMPLETIONS, Kind.COMPLETION, Kind.INFILL, Kind.MESSAGES, Kind.RESPONSES}
)


def classify(method: str, path: str) -> Kind:
    """The kind of a request; only POSTs run the model."""
    if method != "POST":
        return Kind.OTHER
    return _MODEL_PATHS.get(path.rstrip("/") or "/", Kind.OTHER)


def reads_body(kind: Kind) -> bool:
    """Whether slotwise must decode the JSON body (to rewrite and to measure it)."""
    return kind in GENERATING
