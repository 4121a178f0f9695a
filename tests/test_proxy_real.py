"""The proxy in front of a real llama-server: clients see what they would see directly, and every
request's record holds the true figures (queue wait, the server's own timings, client gone)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from proxy.runner import ProxyThread
from proxy.testbed.server import LlamaServer
from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import http, read_records

pytestmark = pytest.mark.real_server

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the sea and the ships on it."}]
FIXED = {"temperature": 0, "seed": 42, "max_tokens": 24}
NO_CACHE = {"cache_prompt": False}  # the same computation on both paths, to the last bit


@pytest.fixture(scope="module")
def server(llama_server_binary: Path, tiny_model: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(tiny_model.model, lora=None, args=["-np", "2", "-c", "8192"],
                     binary=llama_server_binary, log_path=log) as running:
        yield running


@pytest.fixture
def upstream_url(server: LlamaServer) -> str:
    return server.url


def clients(server: LlamaServer, proxy: ProxyThread) -> tuple[openai.OpenAI, openai.OpenAI]:
    return (openai.OpenAI(base_url=server.url + "/v1", api_key="x"),
            openai.OpenAI(base_url=proxy.url + "/v1", api_key="x"))


def test_chat_non_streamed_is_the_same(server: LlamaServer, proxy: ProxyThread) -> None:
    direct, proxied = clients(server, proxy)
    a = direct.chat.completions.create(model="m", messages=MESSAGES, extra_body=NO_CACHE, **FIXED)
    b = proxied.chat.completions.create(model="m", messages=MESSAGES, extra_body=NO_CACHE, **FIXED)
    assert a.choices[0].message.content and a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason == b.choices[0].finish_reason
    assert a.usage == b.usage
    (rec,) = read_records(proxy, 1)
    assert rec["outcome"] == "done" and rec["status"] == 200 and rec["stream"] is False
    assert rec["timings"]["predicted_n"] == b.usage.completion_tokens
    assert rec["prompt_tokens"] == b.usage.prompt_tokens


def chat_stream(client: openai.OpenAI) -> tuple[list[str | None], list[str | None], Any]:
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        extra_body=NO_CACHE, **FIXED)
    deltas, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            deltas.append(choice.delta.content)
            finishes.append(choice.finish_reason)
    return deltas, finishes, usage


def test_chat_streamed_is_the_same_event_for_event(server: LlamaServer, proxy: ProxyThread) -> None:
    direct, proxied = clients(server, proxy)
    a, b = chat_stream(direct), chat_stream(proxied)
    assert a == b and len(a[0]) > 10
    (rec,) = read_records(proxy, 1)
    assert rec["progress_added"] is True  # slotwise asked for progress, and the client never saw it
    assert rec["events"] == sum(1 for d in b[0] if d)
    assert rec["timings"]["predicted_n"] == a[2].completion_tokens


def raw_events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events, with the fields that differ on every call taken out."""
    response = http("POST", url + path, json=body)
    assert response.status_code == 200
    events = []
    for block in response.content.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            obj = orjson.loads(block[6:])
            for volatile in ("id", "created", "timings", "system_fingerprint"):
                obj.pop(volatile, None)
            events.append(obj)
    return events


INFILL = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n"}


@pytest.mark.parametrize("path",
                         ["/v1/chat/completions", "/completion", "/v1/completions", "/infill"])
def test_raw_streams_match_chunk_for_chunk(server: LlamaServer, proxy: ProxyThread,
                                           path: str) -> None:
    body: dict[str, Any] = {"stream": True, "temperature": 0, "seed": 1, "n_predict": 16,
                            "cache_prompt": False}
    if path == "/v1/chat/completions":
        body["messages"] = MESSAGES
    elif path == "/infill":
        body.update(INFILL)
    else:
        body["prompt"] = "Once upon a time"
    direct, proxied = raw_events(server.url, path, body), raw_events(proxy.url, path, body)
    assert len(direct) >= 16
    assert proxied == direct


def test_infill_non_streamed_is_the_same_and_timed(server: LlamaServer,
                                                   proxy: ProxyThread) -> None:
    body = {**INFILL, "n_predict": 8, "temperature": 0, "seed": 1, "cache_prompt": False}
    direct, proxied = (http("POST", url + "/infill", json=body) for url in (server.url, proxy.url))
    assert direct.status_code == proxied.status_code == 200
    a, b = direct.json(), proxied.json()
    assert a["content"] == b["content"] and a["tokens_predicted"] == b["tokens_predicted"] == 8
    (rec,) = read_records(proxy, 1)
    assert (rec["kind"], rec["outcome"], rec["stream"]) == ("infill", "done", False)
    assert rec["prompt_tokens"] == b["timings"]["prompt_n"] + b["timings"]["cache_n"] > 10
    assert rec["timings"]["predicted_n"] == 8


ANTHROPIC = {"model": "m", "max_tokens": 4, "system": "You are terse.",
             "messages": [{"role": "user", "content": "Name three rivers, briefly. " * 8}]}


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_count_the_cached_prompt_too(server: LlamaServer, proxy: ProxyThread,
                                                        stream: bool) -> None:
    """/v1/messages reports only the computed tokens as `input_tokens` and the cached ones apart:
    the record's prompt_tokens is their sum, the same on a warm repeat as on the cold first."""
    body = {**ANTHROPIC, "stream": stream}
    counted = http("POST", server.url + "/v1/messages/count_tokens", json=ANTHROPIC).json()
    for _ in range(2):
        assert http("POST", proxy.url + "/v1/messages", json=body).status_code == 200
    cold, warm = read_records(proxy, 2)
    assert cold["prompt_tokens"] == warm["prompt_tokens"] == counted["input_tokens"] > 30
    assert warm["computed_tokens"] <= 2  # found in the cache: the server recomputes at most one


@pytest.mark.parametrize("stream", [False, True])
def test_responses_count_the_cached_prompt_apart(server: LlamaServer, proxy: ProxyThread,
                                                 stream: bool) -> None:
    body = {"model": "m", "input": "Name three lakes, briefly. " * 8, "max_output_tokens": 4,
            "stream": stream}
    counted = http("POST", server.url + "/v1/responses/input_tokens", json=body).json()
    for _ in range(2):
        assert http("POST", proxy.url + "/v1/responses", json=body).status_code == 200
    cold, warm = read_records(proxy, 2)
    assert cold["prompt_tokens"] == warm["prompt_tokens"] == counted["input_tokens"] > 30
    assert warm["computed_tokens"] <= 2


def test_completions_non_streamed_is_the_same(server: LlamaServer, proxy: ProxyThread) -> None:
    direct, proxied = clients(server, proxy)
    a = direct.completions.create(model="m", prompt="The road", extra_body=NO_CACHE, **FIXED)
    b = proxied.completions.create(model="m", prompt="The road", extra_body=NO_CACHE, **FIXED)
    assert a.choices[0].text and a.choices[0].text == b.choices[0].text
    assert a.usage == b.usage


_CREATED = re.compile(rb'"created":(\d+)')


def _unclocked(body: bytes) -> bytes:
    """The body with llama-server's clock left out: `/v1/models` stamps each model with the second
    it answered (`created`), so two calls a moment apart may differ there alone."""
    return _CREATED.sub(b'"created":0', body)


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/tokenize", {"content": "hello world", "with_pieces": True}),
    ("POST", "/detokenize", {"tokens": [104, 105]}),
    ("GET", "/props", None),
    ("GET", "/health", None),
    ("GET", "/v1/models", None),
    ("GET", "/no-such-endpoint", None),
])
def test_other_endpoints_answer_the_same(server: LlamaServer, proxy: ProxyThread, method: str,
                                         path: str, body: Any) -> None:
    a = http(method, server.url + path, json=body)
    b = http(method, proxy.url + path, json=body)
    assert (a.status_code, _unclocked(a.content)) == (b.status_code, _unclocked(b.content))
    assert a.headers.get("content-type") == b.headers.get("content-type")
    assert b.headers["x-request-id"]


def test_slots_answer_the_same_shape(server: LlamaServer, start_proxy: StartProxy) -> None:
    allowed = start_proxy(server.url, access={"allow": ["GET /slots"]})  # an admin endpoint
    a = http("GET", server.url + "/slots").json()
    b = http("GET", allowed.url + "/slots").json()
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in a] == \
           [(s["id"], s["n_ctx"], s["is_processing"]) for s in b]


def stream_in_thread(url: str, body: dict[str, Any], sink: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        sink["events"] = raw_events(url, "/v1/chat/completions", body)
        sink["done"] = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    return thread


LONG_TOKENS = 2500  # about 2 s on an idle 2-core machine with the tiny model


def wait_until_decoding(proxy: ProxyThread, events: int, timeout: float = 60.0) -> None:
    """Until a request in flight has relayed `events` token events."""
    deadline = time.monotonic() + timeout
    while not any(flight.decoded >= events for flight in proxy.state.registry):
        assert time.monotonic() < deadline, "no request started decoding"
        time.sleep(0.005)


def test_queue_wait_covers_the_time_the_other_request_still_ran(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy) -> None:
    one_slot = start_llama_server(lora=False, args=["-np", "1", "-c", "4096"])
    proxy = start_proxy(one_slot.url)
    long_body = {"messages": MESSAGES, "stream": True, "max_tokens": LONG_TOKENS,
                 "temperature": 0, "ignore_eos": True}
    first: dict[str, Any] = {}
    thread = stream_in_thread(proxy.url, long_body, first)
    wait_until_decoding(proxy, events=20)
    second = raw_events(proxy.url, "/v1/chat/completions",
                        {"messages": MESSAGES, "stream": True, "max_tokens": 8})
    thread.join()
    assert second and first["events"]
    recs = {r["events"]: r for r in read_records(proxy, 2)}
    long_rec, short_rec = recs[max(recs)], recs[min(recs)]
    # Both moments on the proxy's own clock: when the short one was sent, when the long one ended.
    short_sent = _epoch(short_rec["start"]) + short_rec["proxy_ms"] / 1000.0
    still_ran_ms = (_epoch(long_rec["start"]) + long_rec["total_ms"] / 1000.0 - short_sent) * 1000.0
    assert still_ran_ms > 300
    assert short_rec["queue_ms"] >= still_ran_ms - 50  # the server held it until the slot freed
    assert long_rec["queue_ms"] < still_ran_ms / 2  # the long one did not wait like that
    for rec in (long_rec, short_rec):
        server_timings = rec["timings"]
        assert rec["prompt_tokens"] == server_timings["prompt_n"] + server_timings["cache_n"]
    assert long_rec["timings"]["predicted_n"] == LONG_TOKENS


async def test_a_client_that_leaves_mid_stream_stops_the_generation(
        server: LlamaServer, proxy: ProxyThread) -> None:
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 20000, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(proxy.url + "/v1/chat/completions", json=body)
        for _ in range(20):
            await response.content.readline()
        busy = (await (await session.get(server.url + "/slots")).json())
        assert any(slot["is_processing"] for slot in busy)
        response.close()  # the client goes away
        left = time.monotonic()
        while True:
            slots = await (await session.get(server.url + "/slots")).json()
            if not any(slot["is_processing"] for slot in slots):
                break
            assert time.monotonic() - left < 2.0, "the server still generates for nobody"
            await asyncio.sleep(0.05)
    (rec,) = await asyncio.to_thread(read_records, proxy, 1)
    assert rec["outcome"] == "client_gone"
    assert 0 < rec["events"] < 20000


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()




async def test_back_to_back_streams_on_one_connection_all_succeed(
        server: LlamaServer, proxy: ProxyThread) -> None:
    """llama-server closes its end after a stream without saying so; a pooled upstream connection
    must never turn that into an error for the next client."""
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        for _ in range(12):
            async with session.post(proxy.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 200
                assert (await response.read()).endswith(b"data: [DONE]\n\n")
    recs = read_records(proxy, 12)
    assert [r["outcome"] for r in recs] == ["done"] * 12


def test_a_non_streamed_prefill_shows_in_the_records_of_streams_it_overlapped(
        server: LlamaServer, proxy: ProxyThread) -> None:
    long_body = {"messages": MESSAGES, "stream": True, "max_tokens": LONG_TOKENS,
                 "ignore_eos": True}
    first: dict[str, Any] = {}
    thread = stream_in_thread(proxy.url, long_body, first)
    wait_until_decoding(proxy, events=20)
    cold = {"messages": [{"role": "user", "content": "lantern harbor " * 300}], "max_tokens": 4}
    reply = http("POST", proxy.url + "/v1/chat/completions", json=cold)
    thread.join()
    assert reply.status_code == 200
    recs = read_records(proxy, 2)
    plain = next(r for r in recs if not r["stream"])
    streamed = next(r for r in recs if r["stream"])
    (seen,) = [o for o in streamed["overlaps"] if o["id"] == plain["id"]]
    assert seen["computed_tokens"] == plain["timings"]["prompt_n"] > 500
    prefill_s = plain["timings"]["prompt_ms"] / 1000.0
    assert abs((seen["to_ms"] - seen["from_ms"]) / 1000.0 - prefill_s) < 0.05 + 0.2 * prefill_s
