"""The status page and its JSON, against the fake upstream: what is in flight, llama-server's
slots (polled at most once a second), the recent figures; and the page as headless Chromium
renders it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.ops.status import current_rate, prefill_progress, slot_summary
from proxy.record.flight import Phase
from proxy.runner import ProxyThread
from tests.fake_upstream import chat
from tests.helpers import make_flight, serve_app

SLOTS = [
    {"id": 0, "is_processing": True, "n_prompt_tokens": 120, "id_task": 7,
     "next_token": [{"n_decoded": 33}]},
    {"id": 1, "is_processing": True, "n_prompt_tokens": 4000, "id_task": 8,
     "next_token": [{"n_decoded": 0}]},
    {"id": 2, "is_processing": False, "n_prompt_tokens": 0},
]


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[str]]]:
    """A fake llama-server with /slots, and the paths it was asked for."""
    seen: list[str] = []

    async def slots(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response(SLOTS)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/slots", slots)
    async with serve_app(app) as url:
        yield url, seen


@pytest.fixture
def upstream_url(upstream: tuple[str, list[str]]) -> str:
    return upstream[0]


async def slow_stream(url: str, tokens: int, started: asyncio.Event) -> None:
    body = {"model": "slow", "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/chat/completions", json=body,
            headers={"X-Slotwise-Purpose": "roleplay", "X-Slotwise-Client": "ann"}) as response:
        async for _ in response.content.iter_any():
            started.set()


async def get_status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/slotwise/status") as response:
        assert response.status == 200
        status: dict[str, Any] = await response.json()
        return status


async def test_status_shows_a_decoding_stream_the_slots_and_the_recent_figures(
        proxy: ProxyThread, upstream: tuple[str, list[str]]) -> None:
    started = asyncio.Event()
    stream = asyncio.create_task(slow_stream(proxy.url, 30, started))
    await started.wait()
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession() as session:
        began = time.monotonic()
        first = await get_status(session, proxy.url)
        for _ in range(5):
            await get_status(session, proxy.url)
        await asyncio.sleep(0.2)
        status = await get_status(session, proxy.url)
        polls, span = list(upstream[1]), time.monotonic() - began
        await stream
        after = await get_status(session, proxy.url)
    (flight,) = first["flights"]
    assert flight["phase"] == "decoding" and flight["purpose"] == "roleplay"
    assert flight["client"] == "ann" and 5 < flight["rate"] < 40  # 50 ms a token
    assert first["counts"]["decoding"] == 1 and first["config_gen"] == 1
    # seven status calls, at most one /slots poll a second (one, unless the machine is slow)
    assert polls and set(polls) == {"/slots"} and len(polls) <= 1 + int(span)
    assert [s["state"] for s in status["slots"]["slots"]] == [
        "decoding", "waiting/prefilling", "idle"]
    assert after["flights"] == [] and after["recent"]["summary"]["requests"] == 1
    assert after["recent"]["summary"]["ttft_ms"]["n"] == 1
    assert after["config"]["upstream"]["url"] == proxy.config.upstream.url


async def test_the_page_is_one_self_contained_html_file(proxy: ProxyThread) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/slotwise/") as response:
            assert response.status == 200 and response.content_type == "text/html"
            page = await response.text()
        async with session.get(proxy.url + "/slotwise", allow_redirects=False) as response:
            assert response.status == 302 and response.headers["Location"] == "/slotwise/"
    assert "<script>" in page and "<style>" in page
    for external in ("<link", "src=", "@import", "href=", "url("):
        assert external not in page


def test_slot_summary_reads_the_fields_llama_server_answers_mid_decode() -> None:
    assert [slot_summary(s) for s in SLOTS] == [
        {"id": 0, "state": "decoding", "n_prompt_tokens": 120, "n_decoded": 33, "id_task": 7},
        {"id": 1, "state": "waiting/prefilling", "n_prompt_tokens": 4000, "n_decoded": 0,
         "id_task": 8},
        {"id": 2, "state": "idle", "n_prompt_tokens": 0, "n_decoded": 0, "id_task": None},
    ]


def test_current_rate_counts_the_last_three_seconds() -> None:
    tokens = [float(t) / 10 for t in range(100)]  # 10 a second for 10 s
    assert current_rate(tokens, 9.9) == 10.0
    assert current_rate(tokens, 14.9) == 0.0  # silent for five seconds
    assert current_rate([1.0, 1.5], 2.0) == 1.0  # since the first token


def test_prefill_progress_counts_only_the_tokens_to_compute() -> None:
    flight = make_flight("r", 0.0, phase=Phase.PREFILLING, prompt_tokens=5000,
                         computed_tokens=4000, prefill_done_tokens=3000, prefill_start=1.0)
    assert prefill_progress(flight, 3.0) == {"new_tokens": 4000, "prompt_tokens": 5000,
                                             "processed": 3000, "fraction": 0.5,
                                             "elapsed_s": 2.0}


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    return path


def browse(url: str, *extra: str, budget_ms: int = 3000) -> str:
    """Run headless Chromium on `url`; return its stdout (the DOM with --dump-dom)."""
    with tempfile.TemporaryDirectory(prefix="slotwise-chromium-") as profile:
        argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", f"--user-data-dir={profile}",
                f"--virtual-time-budget={budget_ms}", *extra, url]
        done = subprocess.run(argv, capture_output=True, timeout=90, check=True)
    return done.stdout.decode(errors="replace")


async def test_chromium_renders_the_stream_and_the_slots(proxy: ProxyThread) -> None:
    chromium()
    started = asyncio.Event()
    stream = asyncio.create_task(slow_stream(proxy.url, 400, started))
    await started.wait()
    dom = await asyncio.to_thread(browse, proxy.url + "/slotwise/", "--dump-dom")
    stream.cancel()
    await asyncio.gather(stream, return_exceptions=True)
    assert "config generation 1" in dom
    assert '<span class="badge"' in dom and ">decoding</span>" in dom
    assert "tok/s" in dom and "roleplay" in dom
    assert "slot 1: waiting/prefilling" in dom and 'id="clock">cannot reach' not in dom
