"""A kept-alive connection that llama-server already closed must not fail slotwise's next request:
its own calls (pieces, /tokenize, /props, /lora-adapters, /slots) and forwarded ones retry once on a
new connection. The fake server answers one request per connection and drops the connection when a
second one arrives on it, which is what a write on a dead pooled connection meets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from proxy.prefill.feeder import PieceFeeder
from proxy.upstream_call import send

ANSWER = orjson.dumps({"content": "", "timings": {"prompt_n": 64, "cache_n": 0,
                                                  "prompt_ms": 5.0}})


class OneRequestPerConnection:
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
async def upstream() -> AsyncIterator[OneRequestPerConnection]:
    fake = OneRequestPerConnection()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    fake.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield fake


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))


async def test_a_plain_request_on_the_dropped_connection_fails(
        upstream: OneRequestPerConnection) -> None:
    async with session() as s:
        async with s.post(upstream.url + "/tokenize", data=b"{}") as first:
            assert first.status == 200
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with s.post(upstream.url + "/tokenize", data=b"{}"):
                pass


async def test_send_retries_once_on_a_new_connection(upstream: OneRequestPerConnection) -> None:
    async with session() as s:
        for _ in range(3):
            async with await send(s, "POST", upstream.url + "/tokenize", data=b"{}") as response:
                assert response.status == 200
                assert orjson.loads(await response.read())["timings"]["prompt_n"] == 64
    assert upstream.answered == 3 and upstream.connections == 3


async def test_a_body_that_cannot_be_sent_again_is_not_retried(
        upstream: OneRequestPerConnection) -> None:
    async with session() as s:
        async with await send(s, "POST", upstream.url + "/x", data=b"{}"):
            pass
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await send(s, "POST", upstream.url + "/x", data=b"{}", replayable=False)


async def test_pieces_fed_back_to_back_all_reach_the_server(
        upstream: OneRequestPerConnection) -> None:
    async with session() as s:
        feeder = PieceFeeder(s, lambda: upstream.url)
        results = [await feeder.feed(list(range(256)), upto, None) for upto in (64, 128, 192)]
    assert [r.prompt_n for r in results] == [64, 64, 64] and upstream.answered == 3
