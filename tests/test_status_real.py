"""The status page under real load: two slots of a real llama-server busy (one decoding, one
prefilling a long cold prompt) and more requests queued behind them, seen by /slotwise/status,
/metrics and headless Chromium. Set SLOTWISE_SCREENSHOT_DIR to keep the screenshot."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.runner import ProxyThread
from proxy.testbed.server import LlamaServer
from tests.helpers import in_flight_by_phase
from tests.test_status import browse, chromium, get_status

pytestmark = pytest.mark.real_server


@pytest.fixture
def server(llama_server_binary: Path, tiny_model: Any, tmp_path: Path) -> Iterator[LlamaServer]:
    with LlamaServer(tiny_model.model, lora=None, args=["-np", "2", "-c", "32768", "-b", "2048"],
                     binary=llama_server_binary, log_path=tmp_path / "server.log") as running:
        yield running


@pytest.fixture
def upstream_url(server: LlamaServer) -> str:
    return server.url


async def long_prompt(server: LlamaServer, tokens: int) -> str:
    """Text of about `tokens` tokens for this model (words the merges do not join much)."""
    words = " ".join(f"w{i % 997}x{i % 13}" for i in range(tokens))
    async with aiohttp.ClientSession() as session, session.post(
            server.url + "/tokenize", json={"content": words}) as response:
        count = len((await response.json())["tokens"])
    return words[: int(len(words) * min(1.0, tokens / count))]


async def chat(url: str, content: str, tokens: int, who: str, purpose: str) -> None:
    body = {"model": "m", "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": content}]}
    headers = {"X-Slotwise-Client": who, "X-Slotwise-Purpose": purpose}
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/chat/completions", json=body, headers=headers) as response:
        await response.read()


async def wait_for_phases(url: str, wanted: set[tuple[str, str]],
                          timeout: float = 60.0) -> dict[str, Any]:
    """The status once every (client, phase) in `wanted` is seen at the same time."""
    async with aiohttp.ClientSession() as session:
        for _ in range(int(timeout / 0.1)):
            status = await get_status(session, url)
            if wanted <= {(f["client"], f["phase"]) for f in status["flights"]}:
                return status
            await asyncio.sleep(0.1)
    pytest.fail(f"{wanted} never seen together; last: {status['flights']}")


async def test_status_page_during_contention(server: LlamaServer, proxy: ProxyThread,
                                             tmp_path: Path) -> None:
    chromium()
    prompt = await long_prompt(server, 12000)
    load = [asyncio.create_task(chat(proxy.url, "Tell me about ships.", 20, "eve", "warmup"))]
    await load[0]
    load = [asyncio.create_task(chat(proxy.url, "Tell me about the sea.", 6000, "ann", "roleplay"))]
    await wait_for_phases(proxy.url, {("ann", "decoding")})
    load.append(asyncio.create_task(chat(proxy.url, prompt, 50, "bob", "summary")))
    await wait_for_phases(proxy.url, {("bob", "prefilling")})
    load += [asyncio.create_task(chat(proxy.url, f"Hello {i}", 30, f"c{i}", "roleplay"))
             for i in range(2)]
    status = await wait_for_phases(proxy.url, {("ann", "decoding"), ("bob", "prefilling"),
                                               ("c0", "queued"), ("c1", "queued")})
    gauges = await in_flight_gauges(proxy.url)
    after = await busy_slots_status(proxy.url)  # before the browser: the prefill may end meanwhile
    shot = tmp_path / "status.png"
    await asyncio.to_thread(browse, proxy.url + "/slotwise/", f"--screenshot={shot}",
                            "--window-size=1280,900")
    for task in load:
        task.cancel()
    await asyncio.gather(*load, return_exceptions=True)
    keep = os.environ.get("SLOTWISE_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / "status-under-load.png")
    assert shot.stat().st_size > 10_000
    assert sum(gauges.values()) == 4 and gauges["prefilling"] == 1, gauges
    (prefilling,) = [f for f in status["flights"] if f["phase"] == "prefilling"]
    assert prefilling["prefill"]["new_tokens"] > 10000
    busy = [s["state"] for s in after["slots"]["slots"]]
    assert len(busy) == 2 and "idle" not in busy, after["slots"]
    assert after["recent"]["summary"]["requests"] >= 1


async def busy_slots_status(url: str, timeout: float = 15.0) -> dict[str, Any]:
    """The status once its slots (polled from llama-server at most once a second, so a poll can
    lag behind the phases slotwise sees itself) show both slots busy; the last one seen if never."""
    deadline = time.monotonic() + timeout
    while True:
        status = await get_status_once(url)
        states = [s["state"] for s in status["slots"]["slots"]]
        if "idle" not in states or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.2)


async def get_status_once(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        return await get_status(session, url)


async def in_flight_gauges(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return in_flight_by_phase(text)
