"""Load and faults against a fake upstream: what a real llama-server cannot be made to do on demand."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.connector import bodiless_head_end
from tests.conftest import StartProxy
from tests.helpers import read_records


def chat_body(model: str = "fast", tokens: int = 20, stream: bool = True) -> dict[str, Any]:
    return {"model": model, "max_tokens": tokens, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]}


async def read_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bytes:
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
        return await response.read()


async def test_200_concurrent_streams_all_complete_with_200_records(fake_url: str,
                                                                     start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        bodies = await asyncio.gather(*(read_stream(session, proxy.url, chat_body(tokens=50))
                                        for _ in range(200)))
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    assert all(body.count(b"\"content\":\"tok\"") == 50 for body in bodies)
    proxy.stop()
    recs = read_records(proxy)
    assert len(recs) == 200
    assert {r["outcome"] for r in recs} == {"done"}
    assert all(r["events"] == 50 for r in recs)
    assert len({r["id"] for r in recs}) == 200


async def test_reset_mid_stream_gives_a_clear_error_and_the_record_says_so(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url)
    async with aiohttp.ClientSession() as session:
        body = await read_stream(session, proxy.url, chat_body("reset"))
    last = body.strip().split(b"\n\n")[-1]
    error = orjson.loads(last.removeprefix(b"data: "))["error"]
    assert "broke off" in error["message"] and error["type"] == "slotwise_bad_upstream_stream"
    proxy.stop()
    (rec,) = read_records(proxy)
    assert rec["outcome"] == "upstream_error" and "broke off" in rec["error"]
    assert rec["events"] == 10


async def test_garbled_event_is_not_relayed_and_ends_the_stream_with_an_error(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url)
    async with aiohttp.ClientSession() as session:
        body = await read_stream(session, proxy.url, chat_body("garbled"))
    events = body.strip().split(b"\n\n")
    assert b"\"tr\n" not in body
    error = orjson.loads(events[-1].removeprefix(b"data: "))["error"]
    assert "malformed event" in error["message"]
    proxy.stop()
    (rec,) = read_records(proxy)
    assert rec["outcome"] == "upstream_error" and "malformed" in rec["error"]


async def test_an_upstream_that_never_answers_gives_504(fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, upstream={"read_timeout_s": 0.5})
    async with aiohttp.ClientSession() as session, session.post(
            proxy.url + "/v1/chat/completions", json=chat_body("silent")) as response:
        assert response.status == 504
        assert response.headers["X-Slotwise-Error"] == "slotwise_upstream_timeout"
        error = (await response.json())["error"]
    assert "no answer from the upstream within 0.5 s" in error["message"]
    proxy.stop()
    (rec,) = read_records(proxy)
    assert rec["outcome"] == "upstream_error" and rec["status"] == 504


async def test_unreachable_upstream_gives_502(start_proxy: StartProxy) -> None:
    proxy = start_proxy("http://127.0.0.1:9")
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/props") as response:
        assert response.status == 502
        error = (await response.json())["error"]
    assert "cannot connect to the upstream" in error["message"]
    proxy.stop()
    (rec,) = read_records(proxy)
    assert rec["outcome"] == "upstream_error" and rec["endpoint"] == "/props"


async def test_a_body_that_is_not_json_gets_400_where_slotwise_reads_it(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url)
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", data=b"{nope") as response:
            assert response.status == 400
            assert "is not valid JSON" in (await response.json())["error"]["message"]
        async with session.post(proxy.url + "/tokenize", data=b"{nope") as response:
            assert response.status == 200  # forwarded unchanged: slotwise need not read it
            assert (await response.json())["length"] == 5
    proxy.stop()
    assert [r["outcome"] for r in read_records(proxy)] == ["bad_request", "done"]


async def test_a_body_over_the_limit_gets_413(fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, listen={"max_body_mb": 0.01})
    big = {"messages": [{"role": "user", "content": "x" * 20000}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=big) as response:
            assert response.status == 413
            assert "over the limit" in (await response.json())["error"]["message"]
        async with session.post(proxy.url + "/tokenize", data=b"y" * 20000) as response:
            assert response.status == 413
    proxy.stop()
    assert [r["status"] for r in read_records(proxy)] == [413, 413]


async def test_headers_pass_as_a_reverse_proxy_passes_them(fake_url: str,
                                                           start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url)
    headers = {"Authorization": "Bearer k", "X-Slotwise-Client": "ann",
               "X-Slotwise-Purpose": "chat", "Connection": "keep-alive, X-Hop", "X-Hop": "1"}
    async with aiohttp.ClientSession() as session, session.get(
            proxy.url + "/props?x=1%202", headers=headers) as response:
        seen = await response.json()
        rid = response.headers["X-Request-Id"]
    sent = {k.lower(): v for k, v in seen["headers"].items()}
    assert seen["raw_path"] == "/props?x=1%202"
    assert sent["authorization"] == "Bearer k"
    assert sent["x-request-id"] == rid
    assert "x-slotwise-client" not in sent and "x-slotwise-purpose" not in sent
    assert "x-hop" not in sent
    proxy.stop()
    (rec,) = read_records(proxy)
    assert rec["id"] == rid and rec["client"] == "ann" and rec["purpose"] == "chat"


@contextlib.asynccontextmanager
async def raw_upstream(*answer: bytes) -> AsyncIterator[str]:
    """An upstream that answers every request with the bytes given, each part in a write of its
    own 50 ms after the last, then keeps the connection open (as llama-server does)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            await reader.readexactly(int(length.group(1)) if length else 0)
            for i, part in enumerate(answer):
                await asyncio.sleep(0.05 if i else 0)
                writer.write(part)
                await writer.drain()
            await reader.read()  # until slotwise closes its end
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


# llama-server's /cors-proxy relaying a 204 writes a chunked body's terminator after the head
# (llama.cpp's test_mcp_proxy_no_content, issue #26598): no 204 may carry a body.
NO_CONTENT = (b"HTTP/1.1 204 No Content\r\nAccess-Control-Allow-Origin: *\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")


@pytest.mark.parametrize("parts", [(NO_CONTENT + b"0\r\n\r\n",), (NO_CONTENT, b"0\r\n\r\n")],
                         ids=["in-one-read", "terminator-later"])
async def test_a_204_with_a_stray_chunked_terminator_is_passed_on_as_the_204_it_is(
        start_proxy: StartProxy, caplog: pytest.LogCaptureFixture, parts: tuple[bytes, ...]) -> None:
    async with raw_upstream(*parts) as url:
        proxy = start_proxy(url, access={"allow": ["POST /cors-proxy"]})
        async with aiohttp.ClientSession() as session:
            for _ in range(2):  # the connection the stray bytes spoilt is not used again
                async with session.post(proxy.url + "/cors-proxy?url=http://127.0.0.1:1/",
                                        json={}) as response:
                    assert response.status == 204
                    assert await response.read() == b""
    proxy.stop()
    assert [(r["status"], r["outcome"]) for r in read_records(proxy)] == [(204, "done")] * 2
    assert "Traceback" not in caplog.text and "inside slotwise" not in caplog.text


async def test_an_answer_that_is_not_http_is_slotwise_502_naming_the_upstream_problem(
        start_proxy: StartProxy, caplog: pytest.LogCaptureFixture) -> None:
    async with raw_upstream(b"SSH-2.0-OpenSSH_9.6\r\n\r\n") as url:
        proxy = start_proxy(url)
        async with aiohttp.ClientSession() as session, session.get(proxy.url + "/props") as response:
            assert response.status == 502
            assert response.headers["X-Slotwise-Error"] == "slotwise_bad_upstream_stream"
            message = (await response.json())["error"]["message"]
    assert "the upstream's answer is not valid HTTP" in message and "127.0.0.1" not in message
    proxy.stop()
    (rec,) = read_records(proxy)
    assert rec["status"] == 502 and rec["outcome"] == "upstream_error"
    assert "Traceback" not in caplog.text and "inside slotwise" not in caplog.text


@pytest.mark.parametrize("data, end", [
    (b"HTTP/1.1 204 No Content\r\n\r\n0\r\n\r\n", 27), (b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n\r\n", 38),
    (b"HTTP/1.1 204 No Content\r\n", None), (b"HTTP/1.1 200 OK\r\n\r\n0\r\n\r\n", None),
    (b"HTTP/1.1 2040 x\r\n\r\n", None), (b"0\r\n\r\nHTTP/1.1 204 x\r\n\r\n", None)])
def test_the_head_of_a_bodiless_answer_is_found_only_whole_and_at_the_start(
        data: bytes, end: int | None) -> None:
    assert bodiless_head_end(data) == end
