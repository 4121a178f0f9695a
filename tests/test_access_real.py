"""`[access]` in front of a real llama-server (tiny model): its admin endpoints refused unless
allowed (the global LoRA scale read from the server itself), client keys checked before any work
and swapped for the server's key, a keyless client of a keyed server refused before its prompt
is estimated or fed in pieces, and slotwise's pages behind their token."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from proxy.request.errors import PROXY_ERROR_HEADER
from proxy.testbed.server import LlamaServer
from proxy.testbed.words import filler
from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import read_records

pytestmark = pytest.mark.real_server

UP = "server-key"  # llama-server's --api-key
CLIENTS = {"clients": [{"name": "alice", "key": "alice-key"}, {"name": "bob", "key": "bob-key"}]}
CHUNK = {"mode": "chunk", "cold_tokens": 200, "max_stall_ms": 30.0, "prefill_share": 0.9}
KEYED_SERVER = ("--api-key", UP, "--metrics", "-np", "2", "-c", "16384")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cold_body(seed: int, words: int = 700) -> dict[str, Any]:
    text = filler(random.Random(seed), words)
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2, "user": "mallory"}


async def call(session: aiohttp.ClientSession, method: str, url: str, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    async with session.request(method, url, json=body, headers=headers) as response:
        data = await response.json(content_type=None) if response.content_type.endswith("json") \
            else await response.text()
        return response.status, data, dict(response.headers)


async def global_scales(session: aiohttp.ClientSession, server: LlamaServer) -> list[float]:
    """The adapters' global scales, read from the server itself."""
    status, adapters, _ = await call(session, "GET", server.url + "/lora-adapters")
    assert status == 200
    return [a["scale"] for a in adapters]


async def prompt_tokens_total(session: aiohttp.ClientSession, server: LlamaServer) -> float:
    """Prompt tokens the server has computed so far (its own /metrics, with its key)."""
    status, text, _ = await call(session, "GET", server.url + "/metrics", headers=bearer(UP))
    assert status == 200, text
    line = next(li for li in text.splitlines() if li.startswith("llamacpp:prompt_tokens_total "))
    return float(line.split()[1])


def server_log_count(server: LlamaServer, marker: str) -> int:
    return server.log_path.read_text(errors="replace").count(marker)


@contextlib.asynccontextmanager
async def generating(session: aiohttp.ClientSession, url: str, headers: dict[str, str]
                     ) -> AsyncIterator[None]:
    """A long streamed generation through the proxy while the block runs (so a cold prompt is fed
    in pieces); its bytes are drained in the background."""
    body = {"messages": [{"role": "user", "content": "Tell a story."}], "stream": True,
            "max_tokens": 20000, "ignore_eos": True}
    response = await session.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert response.status == 200
    for _ in range(3):
        await response.content.readany()

    async def drain() -> None:
        with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
            while await response.content.readany():
                pass

    task = asyncio.create_task(drain())
    try:
        yield
    finally:
        response.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_admin_endpoints_are_refused_unless_allowed(start_llama_server: StartLlamaServer,
                                                          start_proxy: StartProxy) -> None:
    server = await asyncio.to_thread(start_llama_server)  # the tiny model and its adapter
    proxy = await asyncio.to_thread(start_proxy, server.url)  # no [access] table
    async with aiohttp.ClientSession() as session:
        assert await global_scales(session, server) == [1.0]
        status, body, headers = await call(session, "POST", proxy.url + "/lora-adapters",
                                           [{"id": 0, "scale": 0.0}])
        assert status == 403 and headers[PROXY_ERROR_HEADER] == "permission_error"
        assert '"POST /lora-adapters" to [access] allow' in body["error"]["message"]
        assert await global_scales(session, server) == [1.0]  # unchanged for everybody
        for method, path in (("GET", "/slots"), ("POST", "/slots/0?action=erase"),
                             ("POST", "/props")):
            status, body, _ = await call(session, method, proxy.url + path, {})
            assert status == 403, (method, path, body)
        status, adapters, _ = await call(session, "GET", proxy.url + "/lora-adapters")
        assert status == 200 and adapters[0]["scale"] == 1.0  # reading is for everyone

        allowing = await asyncio.to_thread(start_proxy, server.url,
                                           access={"allow": ["POST /lora-adapters"]})
        status, body, _ = await call(session, "POST", allowing.url + "/lora-adapters",
                                     [{"id": 0, "scale": 0.0}])
        assert status == 200 and body == {"success": True}
        assert await global_scales(session, server) == [0.0]
    records = await asyncio.to_thread(read_records, proxy, 5)
    refused = [r for r in records if r["status"] == 403]
    assert len(refused) == 4 and {r["outcome"] for r in refused} == {"forbidden"}


async def test_client_keys_are_checked_before_any_work_and_swapped_for_the_servers(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy) -> None:
    server = await asyncio.to_thread(start_llama_server, lora=False, args=KEYED_SERVER)
    proxy = await asyncio.to_thread(start_proxy, server.url, upstream={"api_key": UP},
                                    prefill=CHUNK, access={**CLIENTS, "pages_token": "page-token"})
    async with aiohttp.ClientSession() as session:
        before = await prompt_tokens_total(session, server)
        tasks = server_log_count(server, "processing task")
        for headers in ({}, bearer("guess"), bearer(UP)):  # clients never use the server's key
            status, body, reply = await call(session, "POST", proxy.url + "/v1/chat/completions",
                                             cold_body(1), headers)
            assert status == 401 and reply[PROXY_ERROR_HEADER] == "authentication_error", body
            assert reply["WWW-Authenticate"] == 'Bearer realm="slotwise"'
        assert await prompt_tokens_total(session, server) == before
        assert server_log_count(server, "processing task") == tasks
        assert server_log_count(server, "unauthorized") == 0  # nothing reached the server

        headers = {**bearer("alice-key"), "X-Slotwise-Client": "eve"}
        status, body, _ = await call(session, "POST", proxy.url + "/v1/chat/completions",
                                     cold_body(2, words=20), headers)
        assert status == 200, body  # the server wants its own key: slotwise sent it
        status, body, _ = await call(session, "POST", proxy.url + "/v1/messages",
                                     {**cold_body(3, words=20), "max_tokens": 2},
                                     {"x-api-key": "bob-key"})
        assert status == 200, body
        records = await asyncio.to_thread(read_records, proxy, 5)
        status, text, _ = await call(session, "GET", proxy.url + "/metrics",
                                     headers=bearer("page-token"))
        assert 'slotwise_client_requests_total{client="alice",outcome="done"} 1.0' in text
        assert 'slotwise_client_requests_total{client="none",outcome="unauthorized"} 3.0' in text
    refused, alice, bob = records[:3], records[3], records[4]
    for record in refused:
        assert record["outcome"] == "unauthorized" and record["status"] == 401
        assert record["bytes_in"] == 0 and record["est_prompt_tokens"] is None
        assert record["pieces"] == 0 and record["client"] is None
    assert alice["client"] == "alice" and alice["outcome"] == "done"  # not the header, not `user`
    assert bob["client"] == "bob" and bob["outcome"] == "done"


async def test_a_keyless_client_of_a_keyed_server_gets_no_work_done(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy) -> None:
    server = await asyncio.to_thread(start_llama_server, lora=False, args=KEYED_SERVER)
    proxy = await asyncio.to_thread(start_proxy, server.url, upstream={"api_key": UP}, prefill=CHUNK)
    async with aiohttp.ClientSession() as session, \
            generating(session, proxy.url, bearer(UP)):  # so a cold prompt goes in pieces
        before = await prompt_tokens_total(session, server)
        status, body, reply = await call(session, "POST", proxy.url + "/v1/chat/completions",
                                         cold_body(1))
        assert await prompt_tokens_total(session, server) == before  # no piece computed
        assert status == 401 and reply.get(PROXY_ERROR_HEADER) == "authentication_error", body
        assert "[upstream] api_key" in body["error"]["message"]

        status, body, _ = await call(session, "POST", proxy.url + "/v1/chat/completions",
                                     cold_body(1), bearer(UP))
        assert status == 200, body  # the same request with the key is fed in pieces
        assert await prompt_tokens_total(session, server) > before

        # The status page (and its /slots, fetched with the server's key) is not for anyone.
        status, body, _ = await call(session, "GET", proxy.url + "/slotwise/status")
        assert status == 403 and "access.pages_token" in body["error"]["message"]
    records = await asyncio.to_thread(read_records, proxy, 3)
    keyless = next(r for r in records if r["status"] == 401)
    keyed = next(r for r in records if r["status"] == 200 and not r["stream"])
    assert keyless["outcome"] == "unauthorized" and keyless["est_prompt_tokens"] is None
    assert keyless["pieces"] == 0 and keyless["fed_tokens"] == 0
    assert keyed["prefill_plan"] == "chunked" and keyed["fed_tokens"] > 0, keyed


async def test_the_pages_behind_their_token(start_llama_server: StartLlamaServer,
                                            start_proxy: StartProxy) -> None:
    server = await asyncio.to_thread(start_llama_server, lora=False, args=KEYED_SERVER)
    closed = await asyncio.to_thread(start_proxy, server.url, upstream={"api_key": UP})
    async with aiohttp.ClientSession() as session:
        for path in ("/metrics", "/slotwise/", "/slotwise/status"):  # keys in force: off by default
            status, body, _ = await call(session, "GET", closed.url + path)
            assert status == 403 and "set access.pages_token" in body["error"]["message"], path
    proxy = await asyncio.to_thread(start_proxy, server.url, upstream={"api_key": UP},
                                    access={"pages_token": "page-token"})
    async with aiohttp.ClientSession() as session:
        for path in ("/metrics", "/slotwise/", "/slotwise/status"):
            status, body, reply = await call(session, "GET", proxy.url + path)
            assert status == 401 and "access.pages_token" in body["error"]["message"], path
            assert reply["WWW-Authenticate"].startswith("Basic ")
            status, _, _ = await call(session, "GET", proxy.url + path, headers=bearer(UP))
            assert status == 401, path  # the server's key is not the pages' token
        status, text, _ = await call(session, "GET", proxy.url + "/metrics",
                                     headers=bearer("page-token"))
        assert status == 200 and "slotwise_requests_in_flight" in text
        slots: list[Any] = []
        for _ in range(100):  # the page's /slots is fetched in the background, once asked
            status, page, _ = await call(session, "GET", proxy.url + "/slotwise/status",
                                         headers=bearer("page-token"))
            assert status == 200
            slots = page["slots"]["slots"]
            if slots:
                break
            await asyncio.sleep(0.05)
        assert slots and page["slots"]["error"] is None
        assert page["config"]["access"]["pages_token"] == "***"
