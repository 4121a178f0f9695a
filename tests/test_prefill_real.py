"""The prefill gate in front of a real llama-server (tiny model): a chunked prompt finds itself
cached, a cold prompt with nobody generating is not delayed, a held request whose client leaves
never reaches the server, a failed piece fails open, and a turn held for a free slot says how
long."""

from __future__ import annotations

import asyncio
import http.client
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.prefill.feeder import PieceFeeder
from proxy.prefill.gate import PrefillGate
from proxy.request.admission import ADMISSION
from proxy.testbed.server import LlamaServer
from proxy.testbed.words import WORDS as SHARED_WORDS
from proxy.testbed.words import filler
from tests.conftest import StartProxy
from tests.helpers import http as call
from tests.helpers import in_flight_by_phase, read_records

pytestmark = pytest.mark.real_server

WORDS = SHARED_WORDS[:8]  # the sizes these tests were tuned with


def history(words: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    text = filler(rng, words, WORDS)
    return [{"role": "system", "content": f"seed {seed}"}, {"role": "user", "content": text}]


def cold_body(seed: int, words: int = 700) -> dict[str, Any]:
    return {"messages": history(words, seed), "max_tokens": 2, "stream": False}


@pytest.fixture(scope="module")
def server(llama_server_binary: Path, tiny_model: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(tiny_model.model, lora=None, args=["-np", "3", "-c", "24576"],
                     binary=llama_server_binary, log_path=log) as running:
        yield running


def wait_in_flight(url: str, count: int, timeout_s: float = 10.0) -> None:
    """Until slotwise counts `count` requests in flight (its /metrics)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = call("GET", url + "/metrics").content.decode()
        now = sum(in_flight_by_phase(text).values())
        if now == count:
            return
        assert time.monotonic() < deadline, f"slotwise still counts {now} requests in flight"
        time.sleep(0.02)


class Stream:
    """A long streamed generation through the proxy, in a thread, ended by `close()` (which
    shuts the socket down, so the proxy sees the client leave at once)."""

    def __init__(self, url: str, tokens: int = 20000, headers: dict[str, str] | None = None) -> None:
        body = {"messages": [{"role": "user", "content": "Tell a story."}], "stream": True,
                "max_tokens": tokens, "ignore_eos": True}
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
        self.conn.request("POST", "/v1/chat/completions", body=orjson.dumps(body),
                          headers={"Content-Type": "application/json", **(headers or {})})
        self.response = self.conn.getresponse()
        self.events = 0
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        while self.events < 3:
            time.sleep(0.01)

    def _read(self) -> None:
        try:
            while self.response.read1(4096):
                self.events += 1
        except (OSError, ValueError, AttributeError, http.client.HTTPException):
            return  # closed by close()

    def close(self) -> None:
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)
        self.conn.close()


def prefill(mode: str, **over: Any) -> dict[str, Any]:
    return {"prefill": {"mode": mode, "cold_tokens": 1000, **over}}


def test_chunked_prompt_finds_itself_cached(server: LlamaServer,
                                             start_proxy: StartProxy) -> None:
    # Small pieces (max_stall_ms 30), so the prompt is fed in several.
    proxy = start_proxy(server.url, **prefill("chunk", max_stall_ms=30.0, prefill_share=0.9))
    stream = Stream(proxy.url)
    try:
        reply = call("POST", proxy.url + "/v1/chat/completions", cold_body(1))
    finally:
        stream.close()
    assert reply.status_code == 200
    proxy.stop()  # every record written
    cold = next(r for r in read_records(proxy) if not r["stream"])
    timings = cold["timings"]
    total = timings["prompt_n"] + timings["cache_n"]
    assert cold["prefill_plan"] == "chunked" and cold["pieces"] >= 2, cold
    assert cold["est_prompt_tokens"] == total
    # Every token a piece computed is found cached. (Near the end the batch cost may send the
    # rest whole rather than in pieces that no longer pay for their fixed part.)
    assert timings["cache_n"] >= cold["fed_tokens"] >= 0.5 * total, (timings, cold["policy_note"])
    # The pieces are prefill work too: the stream's record sees the whole cold prompt overlap it,
    # and the cold record counts what its pieces computed.
    assert cold["fed_tokens"] + timings["prompt_n"] >= 0.9 * total
    streamed = next(r for r in read_records(proxy) if r["stream"])
    (overlap,) = [o for o in streamed["overlaps"] if o["id"] == cold["id"]]
    assert overlap["computed_tokens"] == cold["fed_tokens"] + timings["prompt_n"]
    assert overlap["decode_events"] > 0 and overlap["to_ms"] > overlap["from_ms"]


def anthropic_cold_body(seed: int, words: int = 700) -> dict[str, Any]:
    """A /v1/messages body as Claude-style clients send it: system blocks, a tool, a tool call
    and its result, then a long new user turn."""
    rng = random.Random(seed)
    text = filler(rng, words, WORDS)
    return {"model": "m", "max_tokens": 2, "system": [{"type": "text", "text": f"seed {seed}"}],
            "tools": [{"name": "lookup", "description": "Look a word up.",
                       "input_schema": {"type": "object",
                                        "properties": {"word": {"type": "string"}}}}],
            "messages": [
                {"role": "user", "content": "What does harbor mean?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "I should look it up."},
                    {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"word": "harbor"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1",
                     "content": [{"type": "text", "text": "a sheltered port"}]},
                    {"type": "text", "text": text}]}]}


def cold_while_streaming(server: LlamaServer, start_proxy: StartProxy, path: str,
                         body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Send `body` to `path` through a chunk-mode proxy while a stream generates: (the server's
    answer, the request's record)."""
    proxy = start_proxy(server.url, **prefill("chunk", max_stall_ms=30.0, prefill_share=0.9))
    stream = Stream(proxy.url)
    try:
        reply = call("POST", proxy.url + path, body)
    finally:
        stream.close()
    assert reply.status_code == 200, reply.text
    proxy.stop()  # every record written
    record = next(r for r in read_records(proxy) if r["endpoint"] == path)
    assert record["prefill_plan"] == "chunked" and record["pieces"] >= 2, record
    answer: dict[str, Any] = reply.json()
    return answer, record


def test_a_cold_anthropic_message_is_fed_in_pieces_and_finds_itself_cached(
        server: LlamaServer, start_proxy: StartProxy) -> None:
    answer, cold = cold_while_streaming(server, start_proxy, "/v1/messages",
                                        anthropic_cold_body(2))
    usage = answer["usage"]
    total = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert cold["est_prompt_tokens"] == cold["prompt_tokens"] == total
    assert usage["cache_read_input_tokens"] >= cold["fed_tokens"] >= 0.5 * total, usage


def test_a_cold_responses_request_is_fed_in_pieces_and_finds_itself_cached(
        server: LlamaServer, start_proxy: StartProxy) -> None:
    rng = random.Random(3)
    text = filler(rng, 700, WORDS)
    body = {"model": "m", "max_output_tokens": 2, "instructions": "seed 3",
            "input": [{"role": "user", "content": "Summarize:"},
                      {"type": "message", "role": "assistant",
                       "content": [{"type": "output_text", "text": "Send it."}]},
                      {"role": "user", "content": [{"type": "input_text", "text": text}]}]}
    answer, cold = cold_while_streaming(server, start_proxy, "/v1/responses", body)
    usage = answer["usage"]
    assert cold["est_prompt_tokens"] == cold["prompt_tokens"] == usage["input_tokens"]
    cached = usage["input_tokens_details"]["cached_tokens"]
    assert cached >= cold["fed_tokens"] >= 0.5 * usage["input_tokens"], usage


def test_cold_prompt_with_nobody_generating_goes_at_full_speed(server: LlamaServer,
                                                               start_proxy: StartProxy) -> None:
    """Nobody generates: whole if short, else in idle pieces back to back (never a pause or a
    hold), so that whoever comes meanwhile waits for one piece."""
    proxy = start_proxy(server.url, **prefill("chunk"))
    assert call("POST", proxy.url + "/v1/chat/completions", cold_body(2)).status_code == 200
    proxy.stop()  # every record written
    (rec,) = read_records(proxy)
    assert rec["est_new_tokens"] >= 1000
    if rec["prefill_plan"] == "none":
        assert rec["policy_note"] == "cold, nobody generating" and rec["pieces"] == 0
        computed = rec["timings"]["prompt_n"]
    else:
        assert rec["prefill_plan"] == "chunked" and rec["pieces"] >= 1
        assert rec["policy_note"].startswith("nobody generating after")
        computed = rec["prompt_tokens"]  # its pieces computed most of it; the rest was cached
    # the server may find a few template tokens cached in some slot; the estimate says 0
    assert abs(rec["est_new_tokens"] - computed) <= 0.05 * rec["est_new_tokens"]


def test_a_prompt_longer_than_a_slot_is_answered_at_once_with_no_piece_fed(
        server: LlamaServer, start_proxy: StartProxy) -> None:
    """Slots of 8,192 tokens: a ~10k-token prompt while a stream runs is not fed in pieces (68 s
    of everyone's time before llama-server's 400, as it was): the server's own error comes at once."""
    proxy = start_proxy(server.url, **prefill("chunk"))
    stream = Stream(proxy.url)
    try:
        started = time.monotonic()
        reply = call("POST", proxy.url + "/v1/chat/completions", cold_body(7, words=7000))
        took = time.monotonic() - started
    finally:
        stream.close()
    assert reply.status_code == 400 and took < 1.5, (reply.status_code, took)
    proxy.stop()  # every record written (the answer can reach the client before its record)
    [rec] = [r for r in read_records(proxy) if r["status"] == 400]
    assert rec["pieces"] == 0 and rec["prefill_plan"] == "none"
    assert "more than a slot holds (8,192): forwarded as it came, no piece fed" in rec["policy_note"]


def _tasks(log: Path) -> int:
    return log.read_text(errors="replace").count("processing task")


def test_held_request_whose_client_leaves_never_reaches_the_server(
        server: LlamaServer, start_proxy: StartProxy) -> None:
    proxy = start_proxy(server.url, **prefill("defer", max_hold_s=60.0))
    stream = Stream(proxy.url)
    before = _tasks(server.log_path)

    async def leave() -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(TimeoutError):
                await session.post(proxy.url + "/v1/chat/completions", json=cold_body(3),
                                   timeout=aiohttp.ClientTimeout(total=1.0))

    asyncio.run(leave())
    time.sleep(0.5)
    stream.close()
    time.sleep(0.3)
    assert _tasks(server.log_path) == before  # the cold request never became a task
    proxy.stop()  # every record written
    cold = next(r for r in read_records(proxy) if not r["stream"])
    assert cold["est_new_tokens"] >= 1000
    assert cold["outcome"] == "client_gone" and cold["prefill_plan"] == "held", cold
    assert cold["held_ms"] >= 500


def test_failed_piece_fails_open(server: LlamaServer, start_proxy: StartProxy) -> None:
    proxy = start_proxy(server.url, **prefill("chunk", max_stall_ms=40.0))
    gate = proxy.app[ADMISSION]
    assert isinstance(gate, PrefillGate)
    # Pieces go to a port nobody listens on; the real request still goes to the server.
    gate._feeder = PieceFeeder(proxy.state.upstream.aimed_at("http://127.0.0.1:9", {}))
    stream = Stream(proxy.url)
    try:
        reply = call("POST", proxy.url + "/v1/chat/completions", cold_body(4))
    finally:
        stream.close()
    assert reply.status_code == 200 and reply.json()["choices"]
    proxy.stop()  # every record written
    cold = next(r for r in read_records(proxy) if not r["stream"])
    assert cold["outcome"] == "done" and cold["pieces"] == 0
    assert cold["policy_note"].startswith("piece failed, forwarded as it came"), cold
    assert cold["timings"]["prompt_n"] >= 0.95 * cold["est_new_tokens"]  # computed in one go


def test_two_cold_prompts_sharing_a_system_prompt_keep_each_other_s_pieces(
        llama_server_binary: Path, tiny_model: Any, tmp_path: Path,
        start_proxy: StartProxy) -> None:
    """Two new conversations of one chat app share its template and short system prompt (~40
    tokens), then differ. Both are fed in pieces beside a stream, taking turns. llama-server
    places each piece by its similarity to the slots: a 128-token first piece of the second
    would share more than a tenth of itself with the first's slot and be put there (rule 17),
    and with no RAM prompt cache to copy it to, the first's pieces would be lost. Every token a
    piece computed is found again by the real request: nothing is computed twice."""
    with LlamaServer(tiny_model.model, lora=None, binary=llama_server_binary,
                     args=["-np", "3", "-c", "24576", "--cache-ram", "0"],
                     log_path=tmp_path / "server.log") as server:
        proxy = start_proxy(server.url, **prefill("chunk", max_stall_ms=30.0, prefill_share=0.5))
        app_prompt = filler(random.Random(99), 6, WORDS)

        def body(seed: int) -> dict[str, Any]:
            text = filler(random.Random(seed), 900, WORDS)
            return {"messages": [{"role": "system", "content": app_prompt},
                                 {"role": "user", "content": f"{seed}: {text}"}],
                    "max_tokens": 2, "stream": False}

        stream = Stream(proxy.url)
        replies: dict[int, int] = {}

        def send(seed: int) -> None:
            replies[seed] = call("POST", proxy.url + "/v1/chat/completions", body(seed)).status_code

        try:
            first = threading.Thread(target=send, args=(11,))
            first.start()
            time.sleep(0.3)  # its first pieces are in
            send(12)
            first.join(60)
        finally:
            stream.close()
        proxy.stop()  # every record written
    assert replies == {11: 200, 12: 200}
    cold = [r for r in read_records(proxy) if not r["stream"]]
    assert [r["prefill_plan"] for r in cold] == ["chunked", "chunked"], cold
    for rec in cold:
        timings = rec["timings"]
        assert rec["pieces"] >= 2 and timings["cache_n"] >= rec["fed_tokens"], (
            timings, rec["fed_tokens"], rec["policy_note"])


def test_a_background_job_is_fed_in_pieces_where_a_chat_turn_goes_whole(
        server: LlamaServer, start_proxy: StartProxy) -> None:
    """`background_purposes = ["translation"]`: beside a stream, a ~450-token translation that
    would stall it over 2 × `max_stall_ms` is fed in pieces; a chat turn of the same size (under
    `cold_tokens` and 512 new tokens) goes whole. (The size keeps the translation's batch, sent
    whole, near twice the 20 ms limit on the tiny model: ~300 tokens took 24 ms, and the fitted
    cost sometimes predicted it under the limit.)"""
    proxy = start_proxy(server.url, **prefill("chunk", cold_tokens=100_000, max_stall_ms=10.0,
                                              background_purposes=["translation"]))
    # with nobody generating, a ~950-token prompt: the batch cost has measured the server
    assert call("POST", proxy.url + "/v1/chat/completions", cold_body(31, 150)).status_code == 200
    stream = Stream(proxy.url)
    try:
        chat = call("POST", proxy.url + "/v1/chat/completions", cold_body(32, 90))
        # the client has the whole answer a moment before slotwise closes the request; the turn
        # still counted, the job would take the last free slot of three and go as a turn
        wait_in_flight(proxy.url, 1)
        job = call("POST", proxy.url + "/v1/chat/completions", cold_body(33, 90),
                   headers={"X-Slotwise-Purpose": "translation"})
    finally:
        stream.close()
    assert chat.status_code == job.status_code == 200
    proxy.stop()  # every record written
    records = [r for r in read_records(proxy) if not r["stream"]]
    turn = [r for r in records if r["purpose"] is None][-1]
    [translation] = [r for r in records if r["purpose"] == "translation"]
    assert 256 <= turn["est_new_tokens"] < 512
    assert turn["prefill_plan"] == "none" and turn["pieces"] == 0, turn["policy_note"]
    assert translation["prefill_plan"] == "chunked" and translation["pieces"] >= 2, (
        translation["policy_note"], translation["est_new_tokens"], translation["inflight_at_start"])
    assert "cold: a background job: sent whole, its" in translation["policy_note"]


def test_a_turn_held_for_a_free_slot_says_so_in_its_record_and_metrics(
        server: LlamaServer, start_proxy: StartProxy) -> None:
    """Three streams hold the server's three slots: a short turn waits in slotwise (sent, it would
    only queue in llama-server) until one ends, and its record and /metrics say how long: what a
    fourth slot would have spared it."""
    proxy = start_proxy(server.url, **prefill("chunk", cold_tokens=100_000))
    streams = [Stream(proxy.url) for _ in range(3)]
    try:
        result: dict[str, Any] = {}
        turn = threading.Thread(target=lambda: result.update(response=call(
            "POST", proxy.url + "/v1/chat/completions", cold_body(41, 20))))
        turn.start()
        wait_in_flight(proxy.url, 4)
        time.sleep(1.0)
        streams[0].close()
        turn.join(30)
    finally:
        for stream in streams:
            stream.close()
    assert result["response"].status_code == 200
    text = call("GET", proxy.url + "/metrics").content.decode()
    waits = [s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == "slotwise_slot_wait_seconds_total"]
    assert sum(waits) >= 0.9
    proxy.stop()  # every record written
    [record] = [r for r in read_records(proxy) if not r["stream"]]
    assert record["policy_note"].startswith("held for a free slot (3 of 3 in use)"), record
    assert 900 <= record["slot_wait_ms"] <= record["held_ms"]
