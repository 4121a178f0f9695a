"""Which endpoint a request is for, and what slotwise must do with it.

Every path llama-server routes to a task that runs the model has its kind, whichever of the server's
aliases the client uses: the table below is the route table of llama.cpp's `tools/server/server.cpp`
(the build the testbed runs), plus `/api/chat`, the Ollama-style path that other llama.cpp builds
route to chat completions. Requests whose tasks generate text are read, rewritten (the LoRA profile)
and measured in detail; the others that run the model (embeddings, rerank, transcriptions, decisions)
are recorded under their kind and relayed as they come, like everything else (`/health`, `/props`,
`/slots`, `/tokenize`, `/apply-template`, the token counters: they do not run the model).
"""

from __future__ import annotations

from proxy.record.kind import Kind

_MODEL_PATHS: dict[str, Kind] = {
    "/chat/completions": Kind.CHAT,
    "/v1/chat/completions": Kind.CHAT,
    "/api/chat": Kind.CHAT,
    "/v1/completions": Kind.COMPLETIONS,
    "/completion": Kind.COMPLETION,
    "/completions": Kind.COMPLETION,  # the native handler, as /completion (not OpenAI's shape)
    "/infill": Kind.INFILL,
    "/v1/messages": Kind.MESSAGES,
    "/v1/responses": Kind.RESPONSES,
    "/responses": Kind.RESPONSES,
    "/embedding": Kind.EMBEDDINGS,
    "/embeddings": Kind.EMBEDDINGS,
    "/v1/embeddings": Kind.EMBEDDINGS,
    "/rerank": Kind.RERANK,
    "/reranking": Kind.RERANK,
    "/v1/rerank": Kind.RERANK,
    "/v1/reranking": Kind.RERANK,
    "/audio/transcriptions": Kind.TRANSCRIPTION,
    "/v1/audio/transcriptions": Kind.TRANSCRIPTION,
    "/v1/systemone": Kind.DECISION,
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
