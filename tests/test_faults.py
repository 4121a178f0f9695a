"""Load and faults against a fake upstream: what a real llama-server cannot be made to do on demand."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import StartProxy
from tests.fake_upstream import make_app
from tests.helpers import read_records, serve_app


@pytest.fixture
async def fake_url() -> AsyncIterator[str]:
    async with serve_app(make_app()) as url:
        yield url


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
