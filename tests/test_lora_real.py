"""The LoRA profile against a real llama-server with the testbed adapter: in passthrough a request
with other LoRA settings waits for the running stream to end; in fixed it starts at once and both
decode together; and requests with and without `lora` reach the server with one identical array."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.app import start
from proxy.config import Config, parse_config
from proxy.ops.lora import LoraConfigError
from proxy.ops.lora_watch import server_global
from proxy.prefill.feeder import PieceFeeder
from proxy.runner import ProxyThread
from proxy.testbed.model import ModelFiles
from proxy.testbed.server import LlamaServer
from proxy.upstream import UpstreamClient
from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import http as call
from tests.helpers import read_records

pytestmark = pytest.mark.real_server

LONG_TOKENS = 2500  # the running stream: seconds of decoding even on a fast, idle machine
SHORT_TOKENS = 120


@dataclass
class Stream:
    request_id: str = ""
    sent: float = 0.0
    events: list[float] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)


def lora_config(url: str, tmp_path: Path, name: str, lora: dict[str, Any]) -> Config:
    return parse_config({"upstream": {"url": url}, "listen": {"port": 0},
                         "log": {"timing": str(tmp_path / f"timing-{name}.jsonl")}, "lora": lora})


async def start_error(config: Config) -> LoraConfigError:
    """The error that stops a proxy's start (`start` cleans up what it began)."""
    with pytest.raises(LoraConfigError) as caught:
        await start(config)
    return caught.value


def records_by_id(proxy: ProxyThread) -> dict[str, dict[str, Any]]:
    return {rec["id"]: rec for rec in read_records(proxy)}


async def chat_stream(session: aiohttp.ClientSession, url: str, stream: Stream, *, text: str,
                      tokens: int, scale: float) -> None:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0,
            "lora": [{"id": 0, "scale": scale}]}
    stream.sent = time.monotonic()
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        stream.request_id = response.headers["X-Request-Id"]
        async for line in response.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                stream.events.append(time.monotonic())
                if len(stream.events) == 20:
                    stream.started.set()


@dataclass
class Contest:
    """A long stream at scale 1.0, and a short one at scale 0 sent while the long one decodes."""

    long: Stream
    short: Stream
    records: dict[str, dict[str, Any]]

    @property
    def short_record(self) -> dict[str, Any]:
        return self.records[self.short.request_id]

    @property
    def long_left_ms(self) -> float:
        """How long the long stream still ran after the short one was sent."""
        return (self.long.events[-1] - self.short.sent) * 1000

    def long_events_during_short(self) -> int:
        first, last = self.short.events[0], self.short.events[-1]
        return sum(first <= t <= last for t in self.long.events)


async def contest(proxy: ProxyThread) -> Contest:
    long, short = Stream(), Stream()
    async with aiohttp.ClientSession() as session:
        long_task = asyncio.create_task(chat_stream(
            session, proxy.url, long, text="Tell me a long story.", tokens=LONG_TOKENS, scale=1.0))
        started = asyncio.create_task(long.started.wait())
        await asyncio.wait([long_task, started], return_when=asyncio.FIRST_COMPLETED)
        assert long.started.is_set(), "the long stream ended before it decoded 20 tokens"
        await chat_stream(session, proxy.url, short, text="Say hi.", tokens=SHORT_TOKENS,
                          scale=0.0)
        await long_task
    await asyncio.to_thread(proxy.stop)
    return Contest(long, short, records_by_id(proxy))


@pytest.fixture
def two_slot_server(start_llama_server: StartLlamaServer) -> LlamaServer:
    return start_llama_server(args=["-np", "2", "-c", "16384"])


@pytest.mark.slow
async def test_other_lora_waits_in_passthrough_and_batches_in_fixed(
        two_slot_server: LlamaServer, tiny_model: ModelFiles, tmp_path: Path,
        start_proxy: StartProxy) -> None:
    url = two_slot_server.url
    passthrough = await contest(await asyncio.to_thread(
        start_proxy, lora_config(url, tmp_path, "passthrough", {"mode": "passthrough"})))
    fixed = await contest(await asyncio.to_thread(start_proxy, lora_config(url, tmp_path, "fixed", {
        "mode": "fixed", "adapters": [{"name": tiny_model.lora.name, "scale": 1.0}]})))
    figures = {name: (round(c.short_record["queue_ms"]), round(c.long_left_ms),
                      c.long_events_during_short())
               for name, c in (("passthrough", passthrough), ("fixed", fixed))}
    print("queue_ms of the scale-0 request, ms the long stream still ran, long-stream events "
          "while the short one decoded:", figures)

    # passthrough: the scale-0 request waits in the server's queue until the long stream ends.
    p = passthrough
    assert p.long_left_ms > 500, "the long stream ended too soon for the test to mean anything"
    assert p.short_record["queue_ms"] > 0.75 * p.long_left_ms
    assert p.short.events[0] >= p.long.events[-1] - 0.05
    assert p.short_record["lora_out"] == [{"id": 0, "scale": 0.0}]

    # fixed: it starts at once (not after the long stream: a twentieth of what it still ran,
    # whatever else loads the machine; ~50-650 ms seen) and both streams decode at the same time.
    f = fixed
    assert f.short_record["queue_ms"] < 0.05 * f.long_left_ms
    assert f.short.events[-1] < f.long.events[-1]
    assert f.long_events_during_short() >= 10
    assert f.short_record["lora_in"] == [{"id": 0, "scale": 0.0}]
    assert f.short_record["lora_out"] == [{"id": 0, "scale": 1.0}]
    assert f.short_record["lora_rewritten"] is True


async def completion(session: aiohttp.ClientSession, url: str, prompt: str,
                     lora: list[dict[str, Any]] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "n_predict": 4, "temperature": 0}
    if lora is not None:
        body["lora"] = lora
    async with session.post(url + "/completion", json=body) as response:
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


async def anthropic_message(session: aiohttp.ClientSession, url: str, server_url: str) -> Any:
    body = {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with session.post(url + "/v1/messages", json=body) as response:
        assert response.status == 200, await response.text()
    async with session.get(server_url + "/slots") as response:  # an admin endpoint for slotwise
        (slot,) = await response.json()
    return slot["params"]["lora"]


async def infill(session: aiohttp.ClientSession, url: str, lora: list[dict[str, Any]]) -> None:
    body = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n", "n_predict": 4,
            "lora": lora}
    async with session.post(url + "/infill", json=body) as response:
        assert response.status == 200, await response.text()


async def slot_lora(session: aiohttp.ClientSession, server_url: str) -> Any:
    async with session.get(server_url + "/slots") as response:
        (slot,) = await response.json()
    return slot["params"]["lora"]


async def test_fixed_sends_one_identical_array_with_and_without_client_lora(
        start_llama_server: StartLlamaServer, tiny_model: ModelFiles, tmp_path: Path,
        start_proxy: StartProxy) -> None:
    server = start_llama_server(args=["-np", "1"])
    proxy = await asyncio.to_thread(start_proxy, lora_config(server.url, tmp_path, "fixed", {
        "mode": "fixed", "adapters": [{"name": tiny_model.lora.name, "scale": 0.5}]}))
    prefix = "The quick brown fox jumps over the lazy dog. " * 20
    async with aiohttp.ClientSession() as session:
        first = await completion(session, proxy.url, prefix + "One", None)
        first_lora = await slot_lora(session, server.url)
        second = await completion(session, proxy.url, prefix + "Two", [{"id": 0, "scale": 1.0}])
        second_lora = await slot_lora(session, server.url)
        messages_lora = await anthropic_message(session, proxy.url, server.url)
        await infill(session, proxy.url, [{"id": 0, "scale": 1.0}])
        infill_lora = await slot_lora(session, server.url)
        async with session.get(server.url + "/lora-adapters") as response:
            global_scales = [round(a["scale"], 4) for a in await response.json()]
    print("slot params.lora:", first_lora, second_lora, "second cache_n:",
          second["timings"]["cache_n"], "/v1/messages:", messages_lora, "global:", global_scales)
    assert first_lora == second_lora == infill_lora == [{"id": 0, "scale": 0.5}]
    infill_record = next(r for r in read_records(proxy, 4) if r["endpoint"] == "/infill")
    assert infill_record["lora_rewritten"] is True and infill_record["outcome"] == "done"
    # /v1/messages drops `lora` (this build): such a request runs on the global scales, which
    # slotwise set to the same profile.
    assert messages_lora in ([], first_lora)
    assert global_scales == [0.5]
    # The same adapters: the shared prefix is reused, not cleared for a LoRA change.
    assert second["timings"]["cache_n"] >= 100
    assert first["timings"]["prompt_n"] >= 100


async def test_a_name_the_server_lacks_stops_the_start_with_what_it_has(
        start_llama_server: StartLlamaServer, tiny_model: ModelFiles, tmp_path: Path) -> None:
    server = start_llama_server()
    config = lora_config(server.url, tmp_path, "bad", {
        "mode": "fixed", "adapters": [{"name": "nope.gguf", "scale": 1.0}]})
    assert str(await start_error(config)) == (
        f"lora.adapters[0].name: 'nope.gguf' is not loaded in the llama-server at {server.url} "
        f"(valid: it has id 0 {tiny_model.lora.name!r})")


async def test_none_without_adapters_forwards_as_sent_and_fixed_is_refused(
        start_llama_server: StartLlamaServer, tmp_path: Path, start_proxy: StartProxy) -> None:
    server = start_llama_server(lora=False)
    proxy = await asyncio.to_thread(start_proxy,
                                    lora_config(server.url, tmp_path, "none", {"mode": "none"}))
    async with aiohttp.ClientSession() as session:
        await completion(session, proxy.url, "Hello", None)
    await asyncio.to_thread(proxy.stop)
    (rec,) = records_by_id(proxy).values()
    assert rec["lora_out"] is None and rec["lora_rewritten"] is False
    error = await start_error(lora_config(server.url, tmp_path, "fixed", {
        "mode": "fixed", "adapters": [{"id": 0}]}))
    assert "'fixed' needs LoRA adapters loaded in llama-server" in str(error)


@pytest.mark.parametrize(("global_lora", "kept"), [(True, 400), (False, 0)])
def test_a_piece_moved_into_a_never_used_slot_keeps_its_prefix_in_fixed(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy,
        global_lora: bool, kept: int) -> None:
    """One shared KV empties every idle slot into the RAM cache whenever a task starts, so a cold
    prompt's next piece goes into a slot never used yet and has its prefix copied back from RAM.
    llama-server then clears it if the piece's explicit `lora` differs from the slot's last list,
    and a never-used slot has none: with `lora.mode` fixed the profile's array wiped it (bench day,
    every run: ann's 1,998-token first turn computed 2,688-3,392 tokens). Sent as the server's
    global list (which the watcher keeps at the profile), the piece keeps it, and so does the real
    request with its explicit profile after it."""
    server = start_llama_server(lora=True, args=["-np", "4", "-kvu", "-c", "16384"])
    fixed = [{"id": 0, "scale": 1.0}]
    proxy = start_proxy(server.url, lora={"mode": "fixed", "adapters": fixed})
    prompt, other = list(range(300, 1100)), list(range(2000, 2300))

    async def pieces() -> tuple[int, int]:
        async with aiohttp.ClientSession() as session:
            upstream = UpstreamClient(session, lambda: server.url)
            profile = partial(server_global, proxy.state) if global_lora else (lambda: None)
            feeder = PieceFeeder(upstream, global_lora=profile)
            first = await feeder.feed(prompt, 400, fixed)
            # another task starts (through slotwise: the profile's array): the piece's slot is
            # emptied into the RAM cache
            started = call("POST", proxy.url + "/completion", {"prompt": other, "n_predict": 2})
            assert started.status_code == 200, started.text
            second = await feeder.feed(prompt, 600, fixed)
            return first.cache_n, second.cache_n

    assert asyncio.run(pieces()) == (0, kept)
    real = call("POST", proxy.url + "/completion", {"prompt": prompt[:700], "n_predict": 2})
    assert real.json()["timings"]["cache_n"] == 600  # the pieces' tokens, whatever they cost
