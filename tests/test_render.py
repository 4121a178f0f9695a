"""The render endpoints and warm-ups as a client can abuse them, against a fake llama-server on
loopback (a real one cannot be made to fail on a body or to vanish on demand): the body's deadline and
size, whose fault an error is, no upstream address in any answer, a prompt longer than a slot, and a
warm-up refused before it is tokenized."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.estimate.tokenizer import counted_ids
from proxy.runner import ProxyThread
from tests.conftest import StartProxy
from tests.helpers import serve_app

SLOT_CTX = 256
RENDER = "/v1/chat/completions/render"


@dataclass
class FakeServer:
    """llama-server's answers for render and warm-ups: a slot of SLOT_CTX tokens, one id per
    character of the prompt, and its 500 for messages it cannot template."""

    calls: Counter[str] = field(default_factory=Counter)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at the end: until then a warm-up's piece (`/completion`) gets no answer."""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_get("/props", self.props)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/apply-template", self.apply_template)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/completion", self.completion)
        return app

    async def completion(self, request: web.Request) -> web.Response:
        await self.release.wait()
        return web.json_response({"error": {"code": 503, "message": "the test is over"}}, status=503)

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({"total_slots": 4, "default_generation_settings": {"n_ctx": SLOT_CTX}})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"meta": {"n_ctx_train": 4096}}]})

    async def apply_template(self, request: web.Request) -> web.Response:
        self.calls["/apply-template"] += 1
        body = await request.json()
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return web.json_response({"error": {"code": 500, "message": "type must be array"}},
                                     status=500)
        return web.json_response({"prompt": "".join(str(m.get("content")) for m in messages)})

    async def tokenize(self, request: web.Request) -> web.Response:
        self.calls["/tokenize"] += 1
        content = (await request.json())["content"]
        return web.Response(body=orjson.dumps({"tokens": [ord(c) % 4096 for c in content]}),
                            content_type="application/json")


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
async def server_url(server: FakeServer) -> AsyncIterator[str]:
    async with serve_app(server.app()) as url:
        yield url
        server.release.set()


def chat(content: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


async def post(proxy: ProxyThread, path: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, \
            session.post(proxy.url + path, data=orjson.dumps(body), headers=headers) as response:
        return response.status, orjson.loads(await response.read())


async def start(start_proxy: StartProxy, url: str, **tables: Any) -> ProxyThread:
    """A proxy started off the test's loop: it asks the fake server (on this loop) as it starts."""
    return await asyncio.to_thread(start_proxy, url, **tables)


# ---- the body: its deadline and its size, as any request's ------------------------------------

async def test_a_render_body_at_1_byte_a_second_is_answered_and_closed_at_the_body_deadline(
        start_proxy: StartProxy, server_url: str) -> None:
    proxy = await start(start_proxy, server_url, listen={"body_timeout_s": 1})
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {RENDER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: 100\r\n\r\n".encode())
    t0 = time.monotonic()

    async def drip() -> None:
        for byte in b'{"messages": [' * 10:
            writer.write(bytes([byte]))
            await asyncio.sleep(1.0)

    dripping = asyncio.create_task(drip())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 408 ") and 0.8 < time.monotonic() - t0 < 2.5
        assert b"X-Slotwise-Error: invalid_request_error" in head
        try:
            rest: bytes | None = await asyncio.wait_for(reader.read(), 3)  # then closed
        except ConnectionResetError:  # closed with a dripped byte unread: a reset is closed too
            rest = None
        assert rest is None or b"did not arrive within 1 s (listen.body_timeout_s)" in rest
        assert time.monotonic() - t0 < 3.5  # not kept lingering
    finally:
        dripping.cancel()
        writer.close()


async def test_a_render_body_over_the_size_limit_is_slotwise_413(
        start_proxy: StartProxy, server_url: str, server: FakeServer) -> None:
    proxy = await start(start_proxy, server_url, listen={"max_body_mb": 0.01})
    status, answer = await post(proxy, RENDER, chat("x" * 20_000))
    assert status == 413
    assert "over the limit of 10485 bytes (listen.max_body_mb)" in answer["error"]["message"]
    assert server.calls["/tokenize"] == 0


# ---- whose fault: 400 for the body, 503 only when the server did not answer -------------------

async def test_a_body_the_server_cannot_template_is_400_not_503(
        start_proxy: StartProxy, server_url: str) -> None:
    proxy = await start(start_proxy, server_url)
    status, answer = await post(proxy, RENDER, {"messages": "not a list"})
    assert status == 400, answer
    message = answer["error"]["message"]
    assert "POST /apply-template answered HTTP 500" in message
    assert server_url.removeprefix("http://") not in message
    status, answer = await post(proxy, RENDER, ["not", "an", "object"])
    assert status == 400 and "must be a JSON object" in answer["error"]["message"]


async def test_no_answer_is_503_and_no_answer_names_the_upstreams_address(
        start_proxy: StartProxy, unused_tcp_port: int) -> None:
    address = f"127.0.0.1:{unused_tcp_port}"
    proxy = await start(start_proxy, f"http://{address}", cluster={"health_timeout_s": 1})
    status, answer = await post(proxy, RENDER, chat("hi"))
    assert status == 503 and "did not answer" in answer["error"]["message"]
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/health") as response:
        health = await response.read()
    assert response.status == 503
    for text in (orjson.dumps(answer), health):
        assert address.encode() not in text and str(unused_tcp_port).encode() not in text


# ---- a prompt no slot can hold ------------------------------------------------------------------

async def test_a_prompt_longer_than_a_slot_is_a_400_naming_the_sizes(
        start_proxy: StartProxy, server_url: str) -> None:
    proxy = await start(start_proxy, server_url)
    status, answer = await post(proxy, RENDER, chat("y" * SLOT_CTX))
    assert status == 200 and len(answer["token_ids"]) == SLOT_CTX
    status, answer = await post(proxy, RENDER, chat("z" * 5000))
    assert status == 400
    assert f"the prompt is 5,000 tokens, more than the {SLOT_CTX} one slot" in answer["error"]["message"]


def test_the_ids_of_a_tokenize_answer_are_counted_without_decoding_it() -> None:
    assert counted_ids(orjson.dumps({"tokens": list(range(1000))})) == 1000
    assert counted_ids(b'{"tokens":[]}') == 0
    assert counted_ids(b'{"tokens":[7]}') == 1
    assert counted_ids(b'{"tokens": [1, 2]}') == 0  # another shape: decoded as it is


async def test_a_warm_up_longer_than_a_slot_is_a_400_naming_the_sizes(
        start_proxy: StartProxy, server_url: str) -> None:
    proxy = await start(start_proxy, server_url, warm={"enabled": True})
    status, answer = await post(proxy, "/slotwise/warm/v1/chat/completions", chat("w" * 5000))
    assert status == 400
    assert "the prompt is 5,000 tokens" in answer["error"]["message"]


# ---- warm-ups: the bounds that need no ids first -----------------------------------------------

async def test_a_warm_up_the_full_queue_has_no_room_for_is_refused_before_it_is_tokenized(
        start_proxy: StartProxy, server_url: str, server: FakeServer) -> None:
    proxy = await start(start_proxy, server_url, warm={"enabled": True, "max_pending": 1})
    status, answer = await post(proxy, "/slotwise/warm/v1/chat/completions", chat("a" * 100),
                                {"X-Slotwise-Client": "ann"})
    assert status == 202 and answer["state"] == "pending", answer
    asked = server.calls.copy()
    status, answer = await post(proxy, "/slotwise/warm/v1/chat/completions", chat("c" * 100),
                                {"X-Slotwise-Client": "bob"})
    assert status == 429 and "warm.max_pending = 1" in answer["error"]["message"]
    assert server.calls == asked, "the refused warm-up was tokenized"
