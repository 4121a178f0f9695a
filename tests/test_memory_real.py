"""Memory a client can make slotwise hold, against a real llama-server: `slotwise serve` as a
process, its RSS read from /proc (issue 20: ten renders of 8 MB bodies took it from 62 to 864 MB,
where it stayed). Large bodies to render, to chat (estimated under `defer`) and to warm: the
proxy's RSS must stay within GROWTH_MB of where it started and come back within SETTLE_S, and its
event loop must not be held for long meanwhile."""

from __future__ import annotations

import asyncio
import io
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.testbed.server import LlamaServer
from proxy.testbed.words import filler
from tests.served import Served, serve, write_config

pytestmark = [pytest.mark.real_server, pytest.mark.slow]

BODY_MB = 8
BODIES = 10
GROWTH_MB = 100
"""Issue 20: ten 8 MB bodies may leave RSS at most this far above where it started..."""
SETTLE_S = 60
BACK_MB = 25
"""... and within SETTLE_S it must be back to within this of it."""
SLOT_CTX = 8192
MAX_DELAY_S = 0.5
"""The longest GET /get_load may take while the bodies are handled (issue 20: 8 MB renders held
the event loop up to 327 ms; decoding an 8 MB body's millions of ids takes a second and more)."""


@pytest.fixture(scope="module")
def server(llama_server_binary: Path, tiny_model: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(tiny_model.model, lora=None, args=["-np", "2", "-c", str(2 * SLOT_CTX)],
                     binary=llama_server_binary, log_path=log) as running:
        yield running


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def big_bodies() -> list[bytes]:
    """BODIES chat bodies of BODY_MB each, all different (no cache finds one for another)."""
    text = filler(random.Random(20), BODY_MB * 1024 * 1024 // 7)
    return [orjson.dumps({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": f"{i} {text}"}]}) for i in range(BODIES)]


async def post(session: aiohttp.ClientSession, url: str, data: bytes) -> int:
    async with session.post(url, data=io.BytesIO(data),  # aiohttp warns of large bytes
                            headers={"Content-Type": "application/json"}) as response:
        await response.read()
        return response.status


async def each_of(session: aiohttp.ClientSession, url: str, bodies: list[bytes]) -> list[int]:
    """One after the other, as the probe sent them: each is answered (not timed out on a server
    busy with the others), so each could leave its ids behind."""
    return [await post(session, url, body) for body in bodies]


async def loop_delays(session: aiohttp.ClientSession, url: str, delays: list[float]) -> None:
    """How long slotwise takes to answer GET /get_load (no I/O of its own) while the large bodies
    are handled: what its event loop is held for."""
    while True:
        t0 = time.monotonic()
        async with session.get(url + "/get_load") as response:
            await response.read()
        delays.append(time.monotonic() - t0)
        await asyncio.sleep(0.05)


async def test_large_bodies_leave_rss_bounded_and_it_comes_back(
        server: LlamaServer, tmp_path: Path, serving: list[Served]) -> None:
    config = write_config(tmp_path / "slotwise.toml", server.url, tmp_path / "timing.jsonl",
                          prefill={"mode": "defer"}, warm={"enabled": True})
    served = await asyncio.to_thread(serve, config)
    serving.append(served)
    pid, url = served.process.pid, served.url
    bodies = await asyncio.to_thread(big_bodies)
    small = orjson.dumps({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hello there"}]})
    delays: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for path in ("/v1/chat/completions/render", "/v1/chat/completions",
                     "/slotwise/warm/v1/chat/completions"):  # everything loaded once
            assert await post(session, url + path, small) in (200, 202)
        start = rss_mb(pid)
        probe = asyncio.create_task(loop_delays(session, url, delays))
        renders, chats = await asyncio.gather(  # two clients at once, each body after the other
            each_of(session, url + "/v1/chat/completions/render", bodies),
            each_of(session, url + "/v1/chat/completions", bodies))
        warms = await each_of(session, url + "/slotwise/warm/v1/chat/completions", bodies[:3])
        probe.cancel()
        after = rss_mb(pid)
    settled, t0 = after, time.monotonic()
    while settled > start + BACK_MB and time.monotonic() - t0 < SETTLE_S:
        await asyncio.sleep(2)
        settled = rss_mb(pid)
    figures = (f"RSS MB: start {start:.0f}, after {after:.0f}, settled {settled:.0f} "
               f"({time.monotonic() - t0:.0f} s later); GET /get_load took at most "
               f"{max(delays) * 1000:.0f} ms meanwhile")
    print(figures)
    assert renders == [400] * BODIES and warms == [400] * 3, (renders, warms)
    assert chats == [400] * BODIES, chats  # llama-server's: over its context
    assert after <= start + GROWTH_MB, figures
    assert settled <= start + BACK_MB, figures
    assert max(delays) < MAX_DELAY_S, figures
