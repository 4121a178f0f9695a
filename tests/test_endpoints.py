"""Every llama-server alias of a model endpoint is that endpoint: its kind, and for the generating ones
the LoRA profile. The route table is llama.cpp's (`tools/server/server.cpp`), plus `/api/chat`, which
other llama.cpp builds route to chat completions; test_endpoints_real.py runs the aliases for real."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from proxy.record.kind import Kind
from proxy.request.endpoints import GENERATING, classify, reads_body
from tests.conftest import StartProxy
from tests.helpers import http, read_records, serve_app

MODEL_ROUTES = {
    "/chat/completions": Kind.CHAT, "/v1/chat/completions": Kind.CHAT, "/api/chat": Kind.CHAT,
    "/v1/completions": Kind.COMPLETIONS,
    "/completion": Kind.COMPLETION, "/completions": Kind.COMPLETION,
    "/infill": Kind.INFILL, "/v1/messages": Kind.MESSAGES,
    "/v1/responses": Kind.RESPONSES, "/responses": Kind.RESPONSES,
    "/embedding": Kind.EMBEDDINGS, "/embeddings": Kind.EMBEDDINGS, "/v1/embeddings": Kind.EMBEDDINGS,
    "/rerank": Kind.RERANK, "/reranking": Kind.RERANK, "/v1/rerank": Kind.RERANK,
    "/v1/reranking": Kind.RERANK,
    "/audio/transcriptions": Kind.TRANSCRIPTION, "/v1/audio/transcriptions": Kind.TRANSCRIPTION,
    "/v1/systemone": Kind.DECISION,
}
# llama-server's other POST routes: the tokenizer's, the token counters, admin and control ones.
NOT_MODEL_ROUTES = (
    "/tokenize", "/detokenize", "/apply-template", "/chat/completions/input_tokens",
    "/v1/chat/completions/input_tokens", "/responses/input_tokens", "/v1/responses/input_tokens",
    "/v1/messages/count_tokens", "/v1/chat/completions/control", "/lora-adapters", "/slots/0",
    "/props", "/v1/streams/lookup", "/models/load",
)


@pytest.mark.parametrize(("path", "kind"), MODEL_ROUTES.items())
def test_every_alias_of_a_model_endpoint_has_its_kind(path: str, kind: Kind) -> None:
    assert classify("POST", path) is kind
    assert reads_body(kind) is (kind in GENERATING)


@pytest.mark.parametrize("path", NOT_MODEL_ROUTES)
def test_routes_that_do_not_run_the_model_are_other(path: str) -> None:
    assert classify("POST", path) is Kind.OTHER


def test_only_posts_run_the_model() -> None:
    assert classify("GET", "/v1/chat/completions") is Kind.OTHER


# --- a build that routes /api/chat: the upstream gets the profile's scales -----------------------

class OllamaPathUpstream:
    """A llama-server that routes /api/chat to chat completions (older llama.cpp builds), with
    one LoRA adapter loaded; it keeps the bodies it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def adapters(self, request: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "path": "/models/style.gguf", "scale": 1.0}])

    async def chat(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return web.json_response({
            "choices": [{"message": {"content": "hi"}}],
            "timings": {"prompt_n": 5, "cache_n": 0, "prompt_ms": 1.0, "predicted_n": 2,
                        "predicted_ms": 2.0}})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/lora-adapters", self.adapters)
        app.router.add_post("/api/chat", self.chat)
        return app


@pytest.fixture
async def ollama_path_upstream() -> AsyncIterator[tuple[str, OllamaPathUpstream]]:
    upstream = OllamaPathUpstream()
    async with serve_app(upstream.app()) as url:
        yield url, upstream


async def test_api_chat_gets_the_lora_profile_and_a_chat_record(
        ollama_path_upstream: tuple[str, OllamaPathUpstream], start_proxy: StartProxy) -> None:
    url, upstream = ollama_path_upstream
    proxy = await asyncio.to_thread(start_proxy, url, lora={
        "mode": "fixed", "adapters": [{"name": "style.gguf", "scale": 0.5}]})
    body = {"messages": [{"role": "user", "content": "hi"}], "lora": [{"id": 0, "scale": 9.0}]}
    reply = await asyncio.to_thread(http, "POST", proxy.url + "/api/chat", body)
    assert reply.status_code == 200, reply.content
    (sent,) = upstream.bodies
    assert sent["lora"] == [{"id": 0, "scale": 0.5}]
    (record,) = read_records(proxy, 1)
    assert (record["kind"], record["lora_rewritten"], record["prompt_tokens"]) == ("chat", True, 5)
    assert orjson.loads(reply.content)["choices"][0]["message"]["content"] == "hi"
