"""slotwise in front of a real llama-server run with `--api-key` (tiny model): its own calls
(`/lora-adapters`, `/props`, `/apply-template`, `/tokenize`, `/slots`) carry the key from
`[upstream] api_key`, a client's request with the key goes through, and one without it gets
slotwise's own 401 (tests/test_access_real.py: before any work is done for it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import read_records

pytestmark = pytest.mark.real_server

KEY = "secret"


async def test_a_keyed_llama_server_behind_slotwise(start_llama_server: StartLlamaServer,
                                                    start_proxy: StartProxy) -> None:
    server = await asyncio.to_thread(start_llama_server, args=("--api-key", KEY))
    proxy = await asyncio.to_thread(
        start_proxy, server.url, upstream={"api_key": KEY},
        lora={"mode": "fixed", "adapters": [{"id": 0, "scale": 1.0}]},
        prefill={"mode": "chunk", "cold_tokens": 200}, access={"pages_token": "page-token"})
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as session:
        async with session.get(server.url + "/slots") as response:
            assert response.status == 401  # the server does want the key
        async with session.get(server.url + "/health") as response:
            assert response.status == 200  # ...but not for /health
        words = " ".join(["river stone lantern quiet"] * 100)  # several hundred tokens
        body: dict[str, Any] = {"messages": [{"role": "user", "content": words}],
                                "max_tokens": 2, "stream": False}
        async with session.post(proxy.url + "/v1/chat/completions", json=body,
                                headers=auth) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["choices"]
        async with session.post(proxy.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 401  # the missing key is told by slotwise itself
            assert response.headers["X-Slotwise-Error"] == "authentication_error"
        records = await asyncio.to_thread(read_records, proxy, 2)
        ok = records[0]
        assert ok["status"] == 200 and ok["lora_rewritten"] is True
        assert ok["lora_out"] == [{"id": 0, "scale": 1.0}]
        assert ok["est_prompt_tokens"] is not None and ok["est_prompt_tokens"] > 200
        slots = await status_slots(session, proxy.url)
        assert slots and all(s["state"] == "idle" for s in slots)


async def status_slots(session: aiohttp.ClientSession, url: str) -> list[Any]:
    """The slots /slotwise/status shows once its background `GET /slots` has answered."""
    deadline = time.monotonic() + 10
    while True:
        async with session.get(url + "/slotwise/status",
                               headers={"Authorization": "Bearer page-token"}) as response:
            status = await response.json()
        assert status["config"]["upstream"]["api_key"] == "***"
        if status["slots"]["slots"] or time.monotonic() > deadline:
            assert status["slots"]["error"] is None, status["slots"]
            return list(status["slots"]["slots"])
        await asyncio.sleep(0.1)
