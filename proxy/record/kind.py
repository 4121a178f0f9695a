"""The kind of a record: which task of llama-server's a request is for, or which of slotwise's own
works it records (a warm-up, a save, a restore, a summary of refusals), as the record's `kind` names
it.

The request path tells a request's kind from the endpoint (`proxy/request/endpoints.py`
`classify`); the record, the usage parsers, the gate and the replay read it. It lives here, below
both.
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
    # -- slotwise's own work, never a request in flight (docs/record.md) ---------------------------
    WARM = "warm"
    KV_SAVE = "kv_save"
    KV_RESTORE = "kv_restore"
    REFUSALS = "refusals"
    """A summary of refused requests not written one by one (`proxy/record/refusals.py`)."""
