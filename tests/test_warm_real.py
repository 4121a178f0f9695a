"""Warm-ups in front of a real llama-server (tiny model): a warmed history makes the later turn find
its prompt cached, DELETE cancels one, a warm-up never runs while a cold request is chunked, and
every warm-up leaves exactly one record."""

from __future__ import annotations

import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.runner import ProxyThread
from proxy.testbed.server import LlamaServer
from proxy.testbed.words import filler
from tests.conftest import StartProxy
from tests.helpers import Reply, read_records
from tests.helpers import http as call
from tests.test_prefill_real import Stream, cold_body

pytestmark = pytest.mark.real_server

WARM = "/slotwise/warm/v1/chat/completions"
SLOW = {"mode": "chunk", "cold_tokens": 1000, "max_stall_ms": 30.0, "prefill_share": 0.3}
"""Small pieces and long pauses while a stream runs: a warm-up or a cold prompt takes seconds."""


@pytest.fixture(scope="module")
def server(llama_server_binary: Path, tiny_model: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(tiny_model.model, lora=None, args=["-np", "4", "-c", "32768"],
                     binary=llama_server_binary, log_path=log) as running:
        yield running


def conversation(seed: int, turns: int = 12) -> list[dict[str, str]]:
    """A history of ~3,500 tokens that ends with the assistant's reply."""
    rng = random.Random(seed)
    history = [{"role": "system", "content": f"conversation {seed}"}]
    for i in range(turns):
        history.append({"role": "user" if i % 2 == 0 else "assistant", "content": filler(rng, 60)})
    return history


def next_turn(history: list[dict[str, str]], text: str = "And then?") -> dict[str, Any]:
    return {"messages": [*history, {"role": "user", "content": text}], "max_tokens": 2,
            "stream": False}


def warm(proxy: ProxyThread, history: list[dict[str, str]]) -> Reply:
    return call("POST", proxy.url + WARM, {"messages": history})


def state(proxy: ProxyThread, warm_id: str) -> dict[str, Any]:
    reply = call("GET", f"{proxy.url}/slotwise/warm/{warm_id}")
    assert reply.status_code == 200, reply.content
    view: dict[str, Any] = reply.json()
    return view


def wait_for(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


def ended(proxy: ProxyThread, warm_id: str) -> dict[str, Any]:
    view: dict[str, Any] = wait_for(lambda: (v := state(proxy, warm_id))["state"] == "ended" and v)
    return view


@pytest.mark.parametrize(("mode", "seed"), [("chunk", 1), ("off", 11)])
def test_a_warmed_history_makes_the_later_turn_find_its_prompt_cached(
        server: LlamaServer, start_proxy: StartProxy, mode: str, seed: int) -> None:
    proxy = start_proxy(server.url, prefill={"mode": mode, "cold_tokens": 1000})
    history = conversation(seed)
    reply = warm(proxy, history)
    assert reply.status_code == 202, reply.content
    asked = reply.json()
    assert reply.headers["location"] == f"/slotwise/warm/{asked['id']}"
    assert asked["est_tokens"] > 2000 and asked["cached"] < 64
    done = ended(proxy, asked["id"])
    assert done["outcome"] == "done" and done["computed_tokens"] >= 0.95 * asked["est_tokens"]
    # A warm-up of what the server holds costs nothing: done at once, no piece.
    again = warm(proxy, history).json()
    assert (again["state"], again["outcome"], again["est_tokens"], again["pieces"]) == (
        "ended", "done", 0, 0)
    assert call("GET", proxy.url + "/slotwise/status").json()["warm"]["ended"]["done"] == 2
    metrics = call("GET", proxy.url + "/metrics").content.decode()
    assert 'slotwise_warmups_ended_total{outcome="done"} 2.0' in metrics
    assert f"slotwise_warm_computed_tokens_total {float(done['computed_tokens'])}" in metrics
    assert call("POST", proxy.url + "/v1/chat/completions", next_turn(history)).status_code == 200
    proxy.stop()
    records = read_records(proxy)
    (turn,) = [r for r in records if r["kind"] == "chat"]
    timings = turn["timings"]
    # The turn carries the history plus the new message: all of the history was found cached.
    assert timings["cache_n"] >= 0.9 * (timings["cache_n"] + timings["prompt_n"]), timings
    assert timings["cache_n"] >= asked["prompt_tokens"]
    assert turn["warmed_tokens"] == done["computed_tokens"] and turn["warm_ids"] == [asked["id"]]
    warm_records = {r["id"]: r for r in records if r["kind"] == "warm"}
    first, second = warm_records[asked["id"]], warm_records[again["id"]]
    assert (first["outcome"], first["status"], first["fed_tokens"]) == ("done", 202,
                                                                          done["computed_tokens"])
    assert first["pieces"] >= 2 and first["prefill_plan"] == "chunked"
    assert (second["outcome"], second["pieces"], second["fed_tokens"]) == ("done", 0, 0)


def test_delete_cancels_a_warm_up(server: LlamaServer, start_proxy: StartProxy) -> None:
    proxy = start_proxy(server.url, prefill=SLOW)
    stream = Stream(proxy.url)  # others generate: small pieces, long pauses
    try:
        asked = warm(proxy, conversation(2)).json()
        wait_for(lambda: state(proxy, asked["id"])["pieces"] >= 2)
        running = call("GET", proxy.url + "/slotwise/status").json()["warm"]["running"]
        assert [w["id"] for w in running] == [asked["id"]]
        assert 'slotwise_warmups{state="running"} 1.0' in call("GET", proxy.url + "/metrics").content.decode()
        reply = call("DELETE", f"{proxy.url}/slotwise/warm/{asked['id']}")
        assert reply.status_code == 200
        cancelled = reply.json()
        assert (cancelled["state"], cancelled["outcome"]) == ("ended", "cancelled")
        assert 0 < cancelled["computed_tokens"] < asked["est_tokens"]
        time.sleep(0.5)
        assert state(proxy, asked["id"])["pieces"] == cancelled["pieces"]  # no piece after it
        missing = call("DELETE", f"{proxy.url}/slotwise/warm/warm-0000")
        assert missing.status_code == 404 and b"no warm-up" in missing.content
    finally:
        stream.close()
    proxy.stop()
    (record,) = [r for r in read_records(proxy) if r["kind"] == "warm"]
    assert record["outcome"] == "cancelled" and record["policy_note"] == "cancelled by its client"
    assert record["fed_tokens"] >= cancelled["computed_tokens"]


def _held(proxy: ProxyThread) -> bool:
    return bool(call("GET", proxy.url + "/slotwise/status").json()["held"])


def test_a_warm_up_never_runs_while_a_cold_request_is_chunked(
        server: LlamaServer, start_proxy: StartProxy) -> None:
    proxy = start_proxy(server.url, prefill=SLOW)
    stream = Stream(proxy.url)
    replies: list[Reply] = []
    cold = threading.Thread(target=lambda: replies.append(
        call("POST", proxy.url + "/v1/chat/completions", cold_body(3))))
    try:
        cold.start()
        wait_for(lambda: _held(proxy))
        asked = warm(proxy, conversation(4)).json()
        seen_held = 0
        while cold.is_alive():
            before = _held(proxy)
            view = state(proxy, asked["id"])
            if before and _held(proxy):  # held before and after: the view is from inside the hold
                assert view["state"] == "pending" and view["pieces"] == 0, view
                seen_held += 1
            time.sleep(0.05)
        assert seen_held >= 3
        # Once the cold request is through, the warm-up goes on (between the stream's tokens).
        wait_for(lambda: state(proxy, asked["id"])["pieces"] >= 1)
    finally:
        stream.close()
        cold.join(60)
    assert replies and replies[0].status_code == 200
    proxy.stop()
    records = read_records(proxy)
    (chunked,) = [r for r in records if r["kind"] == "chat" and not r["stream"]]
    assert chunked["prefill_plan"] == "chunked"
    (warm_record,) = [r for r in records if r["kind"] == "warm"]
    # Its first piece came after the cold request was let go.
    assert warm_record["held_ms"] > 0 and warm_record["pieces"] >= 1


def test_every_warm_up_leaves_one_record(server: LlamaServer, start_proxy: StartProxy) -> None:
    proxy = start_proxy(server.url, prefill=SLOW, warm={"max_pending": 2})
    stream = Stream(proxy.url)
    history = conversation(5)
    try:
        older = warm(proxy, history[:-2]).json()
        newer = warm(proxy, history).json()  # the same conversation, further on: supersedes it
        other = warm(proxy, conversation(6)).json()
        refused = warm(proxy, conversation(7))
        assert refused.status_code == 429 and b"warm.max_pending = 2" in refused.content
        bad = call("POST", proxy.url + WARM, {"messages": []})
        assert bad.status_code == 400 and b"no messages to warm" in bad.content
        assert call("POST", proxy.url + "/slotwise/warm/v1/embeddings", {}).status_code == 404
        assert call("DELETE", f"{proxy.url}/slotwise/warm/{other['id']}").status_code == 200
        wait_for(lambda: state(proxy, newer["id"])["pieces"] >= 1)
        # The turn of the warmed conversation ends its warm-up and finds what it computed.
        assert call("POST", proxy.url + "/v1/chat/completions",
                    next_turn(history)).status_code == 200
    finally:
        stream.close()
    proxy.stop()
    records = read_records(proxy)
    warm_records = [r for r in records if r["kind"] == "warm"]
    assert Counter(r["id"] for r in warm_records).most_common(1)[0][1] == 1  # one each
    by_id = {r["id"]: r for r in warm_records}
    assert by_id[older["id"]]["outcome"] == "superseded"
    assert by_id[older["id"]]["policy_note"] == f"superseded by warm-up {newer['id']}"
    assert by_id[newer["id"]]["outcome"] in ("superseded", "done")
    assert by_id[other["id"]]["outcome"] == "cancelled"
    refusals = sorted((r["status"], r["outcome"]) for r in warm_records
                      if r["id"] not in (older["id"], newer["id"], other["id"]))
    assert refusals == [(400, "bad_request"), (404, "bad_request"), (429, "rejected")]
    (turn,) = [r for r in records if r["kind"] == "chat" and not r["stream"]]
    assert turn["warmed_tokens"] > 0 and newer["id"] in turn["warm_ids"]


def keyed(method: str, url: str, key: str | None, body: Any = None) -> Reply:
    request = urllib.request.Request(url, method=method,
                                     data=orjson.dumps(body) if body is not None else None)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Reply(response.status, dict(response.headers.items()), response.read())
    except urllib.error.HTTPError as error:
        return Reply(error.code, dict(error.headers.items()), error.read())


def test_with_client_keys_a_warm_up_is_its_clients_alone(server: LlamaServer,
                                                         start_proxy: StartProxy) -> None:
    clients = [{"name": "ann", "key": "ann-key-0123"}, {"name": "bob", "key": "bob-key-4567"}]
    proxy = start_proxy(server.url, prefill=SLOW, access={"clients": clients},
                        warm={"max_per_client": 1})
    stream = Stream(proxy.url, headers={"Authorization": "Bearer bob-key-4567"})
    body = {"messages": conversation(8)}
    try:
        assert keyed("POST", proxy.url + WARM, None, body).status_code == 401
        asked = keyed("POST", proxy.url + WARM, "ann-key-0123", body)
        assert asked.status_code == 202
        warm_id = asked.json()["id"]
        again = keyed("POST", proxy.url + WARM, "ann-key-0123", {"messages": conversation(9)})
        assert again.status_code == 429 and b"warm.max_per_client = 1" in again.content
        url = f"{proxy.url}/slotwise/warm/{warm_id}"
        assert keyed("GET", url, "bob-key-4567").status_code == 404
        assert keyed("DELETE", url, "bob-key-4567").status_code == 404
        assert keyed("GET", url, "ann-key-0123").json()["client"] == "ann"
        assert keyed("DELETE", url, "ann-key-0123").json()["outcome"] == "cancelled"
    finally:
        stream.close()
    proxy.stop()
    outcomes = sorted((str(r["client"]), r["outcome"]) for r in read_records(proxy)
                      if r["kind"] == "warm")
    assert outcomes == [("None", "unauthorized"), ("ann", "cancelled"), ("ann", "rejected")]
