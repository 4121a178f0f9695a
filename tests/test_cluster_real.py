"""Two real nodes (testbed llama-server + `slotwise serve` each) behind real vllm-routers on loopback:
cache-aware routing keeps conversations on their node, power_of_two reads the nodes' /get_load, a
dead llama-server is passed over and comes back, and every request is in exactly one node's log.

One cluster for the module (it takes seconds to start); the tests run in file order, the one that
kills a llama-server last, and it starts it again.
"""

from __future__ import annotations

import http.client
import itertools
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.cli import main
from proxy.testbed.cluster import Cluster, Node, find_router
from proxy.testbed.words import filler
from tests.helpers import http as http_call

pytestmark = [pytest.mark.real_server, pytest.mark.slow]

COLD_TOKENS = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Any,
            llama_server_binary: Path) -> Iterator[Cluster]:
    find_router()  # fails with how to install it
    work = tmp_path_factory.mktemp("cluster")
    tables = {"prefill": {"mode": "defer", "cold_tokens": COLD_TOKENS, "max_hold_s": 60}}
    with Cluster(2, work, policy="cache_aware", tables=tables, model=tiny_model,
                 server_args=("-np", "4", "-c", "65536")) as running:
        running.add_router("power_of_two")
        yield running


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    host, _, port = url.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("POST", "/v1/chat/completions", orjson.dumps(body),
                           {"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def streamed_text(raw: bytes) -> str:
    text = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def records(node: Node) -> list[dict[str, Any]]:
    return node.slotwise.records()


def by_client(cluster: Cluster) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Every record of both logs by its client, with the node whose log holds it."""
    found: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for node in cluster.nodes:
        for record in records(node):
            found.setdefault(str(record.get("client")), []).append((node.name, record))
    return found


def wait_records(cluster: Cluster, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(len(records(n)) for n in cluster.nodes) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_cache_aware_keeps_each_conversation_on_its_node(cluster: Cluster) -> None:
    router = cluster.routers[0].url
    rng = random.Random(7)
    conversations = {name: [{"role": "system", "content": f"{name}. " + filler(rng, 120)}]
                     for name in ("conv-a", "conv-b")}
    served: dict[str, list[str]] = {name: [] for name in conversations}
    for turn in range(5):
        for name, messages in conversations.items():
            messages.append({"role": "user", "content": filler(rng, 15)})
            body = {"messages": messages, "stream": True, "max_tokens": 12, "temperature": 0}
            status, headers, raw = post(router, body, {"X-Slotwise-Client": f"{name}-{turn}"})
            assert status == 200, raw[:300]
            served[name].append(headers["x-slotwise-node"])
            messages.append({"role": "assistant", "content": streamed_text(raw)})
    for name, nodes in served.items():
        assert len(set(nodes)) == 1, f"{name} moved between nodes: {nodes}"
    wait_records(cluster, 10)
    found = by_client(cluster)
    for name in conversations:
        turns = []
        for turn in range(5):
            entries = found.get(f"{name}-{turn}", [])
            assert len(entries) == 1, f"{name} turn {turn} is in {len(entries)} logs"
            node, record = entries[0]
            assert node == served[name][turn] and record["node"] == node
            turns.append(record)
        for before, after in itertools.pairwise(turns):
            cached = after["timings"]["cache_n"]
            assert cached >= 0.9 * before["prompt_tokens"], (
                f"{name}: {cached} of the previous {before['prompt_tokens']} prompt tokens cached")


def test_a_render_is_not_tokenized_again_for_the_request(cluster: Cluster) -> None:
    node = cluster.nodes[0].url
    body = {"messages": [{"role": "user", "content": filler(random.Random(3), 40)}], "max_tokens": 2}
    reply = http_call("POST", node + "/v1/chat/completions/render", body)
    assert reply.status_code == 200 and reply.headers["x-slotwise-node"] == "node1"
    ids = reply.json()["token_ids"]
    status, _, _ = post(node, {**body, "stream": True}, {"X-Slotwise-Client": "render-check"})
    assert status == 200
    wait_records(cluster, 11)
    (entry,) = by_client(cluster)["render-check"]
    assert entry[1]["prompt_tokens"] == len(ids) == entry[1]["est_prompt_tokens"]
    metrics = http_call("GET", node + "/metrics").content.decode()
    assert 'slotwise_prompt_ids_cache_lookups_total{result="hit"}' in metrics


class LongGeneration(threading.Thread):
    """A stream sent straight to one node that runs until `stop()` (the client leaves): up to a
    slot's whole context, since the tiny model decodes ~1,700 tokens a second alone on a fast
    CPU (3,500 tokens ended before the router had been asked)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        host, _, port = url.removeprefix("http://").partition(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=120)
        self.tokens = 0
        self.ended = False

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": "Tell a long story."}], "stream": True,
                "max_tokens": 16000, "ignore_eos": True, "temperature": 0}
        self.connection.request("POST", "/v1/chat/completions", orjson.dumps(body),
                                {"Content-Type": "application/json",
                                 "X-Slotwise-Client": "long-generation"})
        response = self.connection.getresponse()
        try:
            while chunk := response.read1(4096):
                self.tokens += chunk.count(b'"content":"')
        except (OSError, ValueError, http.client.HTTPException):
            pass
        self.ended = True

    def stop(self) -> None:
        if self.connection.sock is not None:
            self.connection.sock.shutdown(2)
        self.join(30)
        self.connection.close()


def test_power_of_two_sends_new_requests_past_a_busy_node(cluster: Cluster) -> None:
    busy, idle = cluster.nodes
    generation = LongGeneration(busy.url)
    generation.start()
    cold: dict[str, Any] = {}
    cold_body = {"messages": [{"role": "user", "content": filler(random.Random(11), 400)}],
                 "max_tokens": 2}
    sender = threading.Thread(target=lambda: cold.update(reply=post(
        busy.url, cold_body, {"X-Slotwise-Client": "held-cold"})), daemon=True)
    try:
        deadline = time.monotonic() + 20
        while generation.tokens < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        sender.start()
        load: dict[str, Any] = {}
        while time.monotonic() < deadline:
            load = http_call("GET", busy.url + "/get_load").json()
            if load["held"] == 1:
                break
            time.sleep(0.05)
        assert load["held"] == 1 and load["running"] == 1, load
        assert load["load"] >= 1 + 2 + 400 // COLD_TOKENS, load
        assert http_call("GET", idle.url + "/get_load").json()["load"] == 0
        time.sleep(2.5)  # the router reads every node's /get_load each second
        router = cluster.routers[1].url
        chosen = [post(router, {"messages": [{"role": "user", "content": f"hi {i}"}],
                                "max_tokens": 2}, {"X-Session-Id": f"p2-{i}"})[1]["x-slotwise-node"]
                  for i in range(10)]
        assert not generation.ended, "the long generation ended too early for this test"
        assert chosen == [idle.name] * 10
    finally:
        generation.stop()
        sender.join(60)
    assert cold["reply"][0] == 200


def workers_health(router: str) -> dict[str, bool]:
    workers = http_call("GET", router + "/workers").json()["workers"]
    return {w["url"]: w["is_healthy"] for w in workers}


def wait_for(check: Any, timeout: float) -> float:
    """Seconds until `check()` is true; fails after `timeout`."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_dead_llama_server_is_passed_over_and_comes_back(cluster: Cluster) -> None:
    dead, alive = cluster.nodes
    router = cluster.routers[0].url
    os.kill(dead.server.pid or 0, signal.SIGKILL)
    dead.server.stop()
    # slotwise's own health says so at once (it asks llama-server on each check)
    assert wait_for(lambda: http_call("GET", dead.url + "/health").status_code == 503, 1.0) < 1.0
    assert http_call("GET", dead.url + "/health").json()["status"] == "unavailable"
    served = []
    for i in range(6):
        status, headers, raw = post(router, {"messages": [{"role": "user", "content": f"ping {i}"}],
                                             "max_tokens": 2}, {"X-Slotwise-Client": f"during-{i}"})
        assert status == 200, raw[:300]
        served.append(headers["x-slotwise-node"])
    assert served == [alive.name] * 6
    # the router's health checks (every second, two failures) mark it dead within seconds
    wait_for(lambda: not workers_health(router)[dead.url], 5.0)
    dead.server.start()  # the same port: the node's upstream URL is unchanged
    assert wait_for(lambda: http_call("GET", dead.url + "/health").status_code == 200, 5.0) < 5.0
    wait_for(lambda: workers_health(router)[dead.url], 5.0)
    found = by_client(cluster)
    for i in range(6):  # a failed attempt on the dead node is recorded there; the answer once
        done = [(n, r) for n, r in found[f"during-{i}"] if r["outcome"] == "done"]
        assert [n for n, _ in done] == [alive.name]
        assert all(n == dead.name and r["outcome"] == "upstream_error"
                   for n, r in found[f"during-{i}"] if r["outcome"] != "done")


def test_the_report_over_both_logs_counts_every_request(
        cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    logs = [str(n.slotwise.timing_path) for n in cluster.nodes]
    total = sum(len(records(n)) for n in cluster.nodes)
    assert all(r.get("client") for n in cluster.nodes for r in records(n))
    # with neither X-Slotwise-Client nor `user`, the router's key names the client
    assert all(by_client(cluster)[f"p2-{i}"][0][0] == "node2" for i in range(10))
    assert main(["report", *logs, "--format", "json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    nodes = next(t for t in out["reports"][0]["tables"] if t["key"] == "nodes")
    rows = {row["label"]: row["n"] for row in nodes["rows"]}
    assert rows == {"node1": len(records(cluster.nodes[0])), "node2": len(records(cluster.nodes[1])),
                    "all nodes": total}
