"""slotwise's /metrics: Prometheus text that prometheus-client parses, histograms that count the
requests, in-flight gauges by phase, and a scrape that never reaches the upstream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import parse_config
from proxy.ops.metrics import MAX_PURPOSES, Metrics, Purposes, decode_rate, server_queue_wait_ms
from proxy.record.schema import Record
from proxy.record.timing_log import TimingLog
from proxy.runner import ProxyThread
from proxy.state import ProxyState
from tests.conftest import StartProxy
from tests.fake_upstream import make_app
from tests.helpers import serve_app


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[str]]]:
    """The fake llama-server, and the paths it was asked for."""
    seen: list[str] = []

    @web.middleware
    async def note(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.append(request.path)
        response: web.StreamResponse = await handler(request)
        return response

    app = make_app()
    app.middlewares.append(note)
    async with serve_app(app) as url:
        yield url, seen


@pytest.fixture
def upstream_url(upstream: tuple[str, list[str]]) -> str:
    return upstream[0]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


async def chat(session: aiohttp.ClientSession, url: str, *, model: str = "fast", tokens: int = 5,
               purpose: str = "chat", stream: bool = True) -> bytes:
    body = {"model": model, "stream": stream, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers={"X-Slotwise-Purpose": purpose}) as response:
        return await response.read()


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return await response.text()


async def test_histograms_and_counters_count_the_requests(proxy: ProxyThread,
                                                          upstream: tuple[str, list[str]]) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            await chat(session, proxy.url, model="slow", tokens=6)
        await chat(session, proxy.url, purpose="title", stream=False)
        await chat(session, proxy.url, model="reset", tokens=10)
        text = await scrape(session, proxy.url)
    got = samples(text)
    chats = {"endpoint": "chat", "purpose": "chat"}
    title = {"endpoint": "chat", "purpose": "title"}
    assert got[key("slotwise_time_to_first_token_seconds_count", **chats)] == 4
    assert got[key("slotwise_server_queue_wait_seconds_count", **chats)] == 4
    assert got[key("slotwise_server_queue_wait_seconds_count", **title)] == 1
    assert got[key("slotwise_decode_rate_tokens_per_second_count", **chats)] >= 3
    # three streams of 6 token events and one cut after 5: 3 * 5 + 4 gaps
    assert got[key("slotwise_inter_token_gap_seconds_count", **chats)] == 19
    assert got[key("slotwise_inter_token_gap_seconds_bucket", **chats, le="0.02")] <= 4
    assert got[key("slotwise_requests_total", **chats, outcome="done")] == 3
    assert got[key("slotwise_requests_total", **chats, outcome="upstream_error")] == 1
    assert got[key("slotwise_requests_total", **title, outcome="done")] == 1
    assert got[key("slotwise_config_generation")] == 1
    assert "/metrics" not in upstream[1]


async def test_in_flight_gauge_shows_a_decoding_stream(proxy: ProxyThread) -> None:
    async with aiohttp.ClientSession() as session:
        stream = asyncio.create_task(chat(session, proxy.url, model="slow", tokens=40))
        for _ in range(100):
            got = samples(await scrape(session, proxy.url))
            if got[key("slotwise_requests_in_flight", phase="decoding")] == 1:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the stream never showed as decoding")
        await stream
        got = samples(await scrape(session, proxy.url))
    assert all(value == 0 for (name, _), value in got.items()
               if name == "slotwise_requests_in_flight")


async def test_a_running_stream_shows_its_first_token_and_gaps_before_it_ends(
        proxy: ProxyThread) -> None:
    chats = {"endpoint": "chat", "purpose": "chat"}
    async with aiohttp.ClientSession() as session:
        stream = asyncio.create_task(chat(session, proxy.url, model="slow", tokens=40))
        for _ in range(200):
            got = samples(await scrape(session, proxy.url))
            if got.get(key("slotwise_inter_token_gap_seconds_count", **chats), 0) >= 5:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("no gap was observed while the stream ran")
        assert not stream.done()
        assert got[key("slotwise_time_to_first_token_seconds_count", **chats)] == 1
        assert got[key("slotwise_server_queue_wait_seconds_count", **chats)] == 1
        await stream
        await asyncio.sleep(0.1)  # the record is written just after the last byte
        got = samples(await scrape(session, proxy.url))
    # each gap once, whether seen at a scrape or at the end; the first token observed once
    assert got[key("slotwise_inter_token_gap_seconds_count", **chats)] == 39
    assert got[key("slotwise_time_to_first_token_seconds_count", **chats)] == 1
    assert got[key("slotwise_server_queue_wait_seconds_count", **chats)] == 1
    assert got[key("slotwise_requests_total", **chats, outcome="done")] == 1


async def test_two_proxies_in_one_process_keep_their_own_registries(
        upstream_url: str, start_proxy: StartProxy) -> None:
    first, second = start_proxy(upstream_url), start_proxy(upstream_url)
    async with aiohttp.ClientSession() as session:
        await chat(session, first.url)
        text_a, text_b = await scrape(session, first.url), await scrape(session, second.url)
    done = key("slotwise_requests_total", endpoint="chat", outcome="done", purpose="chat")
    assert samples(text_a)[done] == 1
    assert done not in samples(text_b)


def test_server_queue_wait_for_streams_and_for_plain_answers() -> None:
    assert server_queue_wait_ms(Record(id="r", stream=True, queue_ms=12.5)) == 12.5
    assert server_queue_wait_ms(Record(id="r", stream=False, prefill_wait_ms=900.0,
                                 proxy_ms=100.0)) == 800.0
    assert server_queue_wait_ms(Record(id="r", stream=False, prefill_wait_ms=None,
                                 proxy_ms=1.0)) is None


def test_decode_rate_counts_gaps_over_the_decode() -> None:
    assert decode_rate(Record(id="r", events=11, decode_ms=500.0)) == 20.0
    assert decode_rate(Record(id="r", events=1, decode_ms=0.0)) is None
    assert decode_rate(Record(id="r", events=5, decode_ms=0.0)) is None


def test_purposes_past_the_cap_count_as_other() -> None:
    purposes = Purposes()
    names = [purposes.label(f"p{i}") for i in range(MAX_PURPOSES + 3)]
    assert names[:MAX_PURPOSES] == [f"p{i}" for i in range(MAX_PURPOSES)]
    assert names[MAX_PURPOSES:] == ["other"] * 3
    assert purposes.label("p0") == "p0"
    assert purposes.label(None) == "none"


async def test_slot_waits_count_what_more_slots_would_have_spared(tmp_path: Any) -> None:
    """Requests held because every slot was in use: how many, and for how long in all."""
    config = parse_config({"upstream": {"url": "http://127.0.0.1:9"},
                           "log": {"timing": str(tmp_path / "timing.jsonl")}})
    async with aiohttp.ClientSession() as session:
        state = ProxyState(config=config, timing_log=TimingLog(config.log.timing), session=session)
        try:
            metrics = Metrics(state)
            for rid, wait in (("a", 2500.0), ("b", 500.0), ("c", 0.0)):
                metrics.observe_record(Record(id=rid, kind="chat", purpose="chat",
                                              prefill_plan="held", held_ms=3000.0,
                                              slot_wait_ms=wait))
            found = samples(metrics.exposition().decode())
        finally:
            state.timing_log.close()
    assert found[key("slotwise_slot_waits_total", endpoint="chat", purpose="chat")] == 2
    assert found[key("slotwise_slot_wait_seconds_total", endpoint="chat",
                     purpose="chat")] == pytest.approx(3.0)
