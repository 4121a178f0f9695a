"""llama-server's aliases of model endpoints through slotwise, for real: with `[lora] fixed` the server
runs each on the profile's scales whatever the client sent (its `/slots` shows the last task's
`lora`), and the record has the endpoint's kind and its measurements."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from proxy.runner import ProxyThread
from proxy.testbed.model import ModelFiles
from proxy.testbed.server import LlamaServer
from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import read_records

pytestmark = pytest.mark.real_server

PROFILE = [{"id": 0, "scale": 0.5}]
CLIENT_LORA = [{"id": 0, "scale": 9.0}]
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
def server(start_llama_server: StartLlamaServer) -> LlamaServer:
    return start_llama_server(args=["-np", "1"])


@pytest.fixture
async def fixed_proxy(server: LlamaServer, tiny_model: ModelFiles,
                      start_proxy: StartProxy) -> ProxyThread:
    proxy: ProxyThread = await asyncio.to_thread(start_proxy, server.url, lora={
        "mode": "fixed", "adapters": [{"name": tiny_model.lora.name, "scale": 0.5}]})
    return proxy


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with session.post(url, json=body) as response:
        return response.status, await response.read()


async def slot_lora(session: aiohttp.ClientSession, server: LlamaServer) -> Any:
    async with session.get(server.url + "/slots") as response:
        (slot,) = await response.json()
    return slot["params"]["lora"]


@pytest.mark.parametrize(("path", "body", "kind"), [
    ("/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "stream": True}, "chat"),
    ("/completions", {"prompt": "Say hi.", "n_predict": 4, "stream": True}, "completion"),
    ("/responses", {"input": "Say hi.", "max_output_tokens": 4, "stream": True}, "responses"),
])
async def test_an_alias_runs_on_the_profile_and_is_measured_as_its_endpoint(
        server: LlamaServer, fixed_proxy: ProxyThread, path: str, body: dict[str, Any],
        kind: str) -> None:
    async with aiohttp.ClientSession() as session:
        status, _ = await post(session, fixed_proxy.url + path, {**body, "lora": CLIENT_LORA,
                                                                 "temperature": 0})
        assert status == 200
        assert await slot_lora(session, server) == PROFILE
    (record,) = read_records(fixed_proxy, 1)
    assert (record["endpoint"], record["kind"], record["outcome"]) == (path, kind, "done")
    assert record["lora_rewritten"] is True and record["lora_out"] == PROFILE
    assert record["events"] > 0 and record["ttft_ms"] is not None
    assert record["prompt_tokens"] is not None


async def test_api_chat_is_a_chat_request_and_answers_as_the_server_does(
        server: LlamaServer, fixed_proxy: ProxyThread) -> None:
    """This build of llama-server does not route /api/chat (404); builds that do run it as chat
    completions (test_endpoints.py shows the upstream then gets the profile's scales)."""
    body = {"messages": MESSAGES, "max_tokens": 4, "lora": CLIENT_LORA}
    async with aiohttp.ClientSession() as session:
        direct = await post(session, server.url + "/api/chat", body)
        through = await post(session, fixed_proxy.url + "/api/chat", body)
        if direct[0] == 200:
            assert await slot_lora(session, server) == PROFILE
    assert through[0] == direct[0]
    if direct[0] != 200:  # an error body passes through unchanged
        assert through[1] == direct[1]
    (record,) = read_records(fixed_proxy, 1)
    assert (record["kind"], record["status"]) == ("chat", direct[0])
    assert record["lora_rewritten"] is True and record["lora_out"] == PROFILE
