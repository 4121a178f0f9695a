"""slotwise's own calls to llama-server through `UpstreamClient`, against fakes on loopback: the one
retry after a dead kept-alive connection (also `send` for forwarded requests), timeouts, HTTP errors,
bad JSON, and the URL and key read per call so that a reload applies at once."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.config import parse_config
from proxy.prefill.feeder import PieceFeeder
from proxy.record.timing_log import TimingLog
from proxy.state import ProxyState
from proxy.upstream import UpstreamCallError, UpstreamClient, send
from tests.helpers import serve_app

ANSWER = orjson.dumps({"content": "", "timings": {"prompt_n": 64, "cache_n": 0,
                                                  "prompt_ms": 5.0}})


class OneRequestPerConnection:
    """Answers one request per connection and drops the connection when a second one arrives on
    it: what a write on a pooled connection llama-server already closed meets."""

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = True
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if not first:  # a second request on this connection: drop it unanswered
                writer.close()
                return
            first = False
            self.answered += 1
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
            await writer.drain()


@pytest.fixture
async def dropping() -> AsyncIterator[OneRequestPerConnection]:
    fake = OneRequestPerConnection()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield fake


def one_connection_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))


class Fake:
    """A llama-server stand-in: records each request's method, path, headers and body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.slow_s = 0.0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append((request.method, request.path, dict(request.headers),
                          await request.read()))
        if request.path == "/slow":
            await asyncio.sleep(self.slow_s)
        if request.path == "/error":
            return web.Response(status=500, body=b"x" * 150 + b"y" * 150)
        if request.path == "/not-json":
            return web.Response(body=b"<html>not json</html>")
        return web.json_response({"path": request.path})


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Fake, str]]:
    upstream = Fake()
    async with serve_app(upstream.app()) as url:
        yield upstream, url


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        yield session


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def caught(call: Any) -> UpstreamCallError:
    with pytest.raises(UpstreamCallError) as info:
        await call
    return info.value


# The one retry after a dead kept-alive connection.

async def test_a_plain_request_on_the_dropped_connection_fails(
        dropping: OneRequestPerConnection) -> None:
    async with one_connection_session() as s:
        async with s.post(dropping.url + "/tokenize", data=b"{}") as first:
            assert first.status == 200
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with s.post(dropping.url + "/tokenize", data=b"{}"):
                pass


async def test_send_retries_once_on_a_new_connection(dropping: OneRequestPerConnection) -> None:
    async with one_connection_session() as s:
        for _ in range(3):
            async with await send(s, "POST", dropping.url + "/tokenize", data=b"{}") as response:
                assert response.status == 200
                assert orjson.loads(await response.read())["timings"]["prompt_n"] == 64
    assert dropping.answered == 3 and dropping.connections == 3


async def test_a_body_that_cannot_be_sent_again_is_not_retried(
        dropping: OneRequestPerConnection) -> None:
    async with one_connection_session() as s:
        async with await send(s, "POST", dropping.url + "/x", data=b"{}"):
            pass
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await send(s, "POST", dropping.url + "/x", data=b"{}", replayable=False)


async def test_the_clients_calls_back_to_back_all_reach_the_server(
        dropping: OneRequestPerConnection) -> None:
    async with one_connection_session() as s:
        client = UpstreamClient(s, lambda: dropping.url)
        answers = [await client.get_json("/props", timeout_s=5.0),
                   await client.post_json("/tokenize", {"content": "hi"}, timeout_s=5.0),
                   await client.get_json("/slots", timeout_s=5.0)]
    assert all(a["timings"]["prompt_n"] == 64 for a in answers)
    assert dropping.answered == 3 and dropping.connections == 3


async def test_pieces_fed_back_to_back_all_reach_the_server(
        dropping: OneRequestPerConnection) -> None:
    async with one_connection_session() as s:
        feeder = PieceFeeder(UpstreamClient(s, lambda: dropping.url))
        results = [await feeder.feed(list(range(256)), upto, None) for upto in (64, 128, 192)]
    assert [r.prompt_n for r in results] == [64, 64, 64] and dropping.answered == 3


# What goes out, and what comes back.

async def test_post_sends_json_asks_for_identity_and_decodes_the_answer(
        fake: tuple[Fake, str], session: aiohttp.ClientSession) -> None:
    upstream, url = fake
    client = UpstreamClient(session, lambda: url + "/")
    assert await client.post_json("/tokenize", {"content": "é", "n": [1]}, timeout_s=5.0) == {
        "path": "/tokenize"}
    method, path, headers, body = upstream.seen[-1]
    assert (method, path, orjson.loads(body)) == ("POST", "/tokenize", {"content": "é", "n": [1]})
    assert headers["Content-Type"] == "application/json"
    assert headers["Accept-Encoding"] == "identity"
    assert "Authorization" not in headers


async def test_get_sends_no_body_and_no_content_type(
        fake: tuple[Fake, str], session: aiohttp.ClientSession) -> None:
    upstream, url = fake
    assert await UpstreamClient(session, lambda: url).get_json("/props", timeout_s=5.0) == {
        "path": "/props"}
    method, _, headers, body = upstream.seen[-1]
    assert (method, body) == ("GET", b"") and "Content-Type" not in headers


async def test_the_url_and_key_are_read_per_call(session: aiohttp.ClientSession) -> None:
    one, two = Fake(), Fake()
    async with serve_app(one.app()) as url_one, serve_app(two.app()) as url_two:
        target = {"url": url_one, "key": "k-one"}
        client = UpstreamClient(session, lambda: target["url"],
                                lambda: {"Authorization": f"Bearer {target['key']}"})
        await client.get_json("/props", timeout_s=5.0)
        target.update(url=url_two, key="k-two")  # what a reload does
        await client.post_json("/tokenize", {}, timeout_s=5.0)
        await client.aimed_at(url_one, {"Authorization": "Bearer k-new"}).get_json(
            "/lora-adapters", timeout_s=5.0)
    assert [(p, h["Authorization"]) for _, p, h, _ in one.seen] == [
        ("/props", "Bearer k-one"), ("/lora-adapters", "Bearer k-new")]
    assert [(p, h["Authorization"]) for _, p, h, _ in two.seen] == [("/tokenize", "Bearer k-two")]


async def test_the_proxys_client_follows_a_reloaded_key(
        fake: tuple[Fake, str], session: aiohttp.ClientSession, tmp_path: Path) -> None:
    upstream, url = fake
    config = parse_config({"upstream": {"url": url, "api_key": "k-one"},
                           "log": {"timing": str(tmp_path / "timing.jsonl")}})
    state = ProxyState(config=config, timing_log=TimingLog(config.log.timing), session=session)
    try:
        await state.upstream.get_json("/props", timeout_s=5.0)
        await state.apply_config(parse_config({"upstream": {"url": url, "api_key": "k-two"},
                                               "log": {"timing": config.log.timing}}))
        await state.upstream.get_json("/props", timeout_s=5.0)
    finally:
        state.timing_log.close()
    assert [h["Authorization"] for _, _, h, _ in upstream.seen] == ["Bearer k-one", "Bearer k-two"]


# One error type: the call, and what went wrong.

async def test_an_unreachable_server_is_a_call_error_without_status(
        session: aiohttp.ClientSession) -> None:
    url = closed_port_url()
    error = await caught(UpstreamClient(session, lambda: url).get_json("/props", timeout_s=5.0))
    assert error.status is None
    assert str(error).startswith(f"GET {url}/props failed: ClientConnectorError")


async def test_a_slow_answer_is_a_timeout(fake: tuple[Fake, str],
                                          session: aiohttp.ClientSession) -> None:
    upstream, url = fake
    upstream.slow_s = 5.0
    error = await caught(UpstreamClient(session, lambda: url).post_json(
        "/slow", {}, timeout_s=0.2))
    assert error.status is None
    assert str(error) == f"POST {url}/slow failed: no answer within 0.2 s"


async def test_an_http_error_names_the_status_and_quotes_200_bytes(
        fake: tuple[Fake, str], session: aiohttp.ClientSession) -> None:
    _, url = fake
    error = await caught(UpstreamClient(session, lambda: url).get_json("/error", timeout_s=5.0))
    assert error.status == 500
    assert str(error) == f"GET {url}/error answered HTTP 500: " + "x" * 150 + "y" * 50


async def test_an_answer_that_is_not_json_is_a_call_error(
        fake: tuple[Fake, str], session: aiohttp.ClientSession) -> None:
    _, url = fake
    error = await caught(UpstreamClient(session, lambda: url).get_json("/not-json",
                                                                        timeout_s=5.0))
    assert error.status == 200
    assert str(error).startswith(f"GET {url}/not-json answered with invalid JSON")
