"""The kind of a request: which task of llama-server's it is for, as the record's `kind` names it.

The request path tells the kind from the endpoint (`proxy/request/endpoints.py` `classify`); the
record, the usage parsers, the gate and the replay read it. It lives here, below both.
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
    RERANK = "rerank"
    TRANSCRIPTION = "transcription"  # audio in a multipart form: the body is never read
    DECISION = "decision"  # /v1/systemone, for decision models
    OTHER = "other"
