"""What a router needs from a node, in pure code: the load figure (one test class per rule of
`proxy/cluster/load.py`), the estimator's use of the prompt ids cache (its own rules:
test_ids_cache.py), render's error mapping, the client's fallbacks, the `[cluster]` config and the
report over several nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.cli import main
from proxy.cluster.load import NodeLoad, node_load, pending_tokens, sglang_body, vllm_body
from proxy.cluster.render import render_error
from proxy.config import ConfigError, PrefillConfig, parse_config
from proxy.estimate import EstimateError, NotEstimable
from proxy.prefill.estimator import Estimator
from proxy.record.flight import Flight, Phase
from proxy.record.kind import Kind
from proxy.record.node import node_name
from proxy.record.timing import RequestTimer
from proxy.report.nodes import group_by_node, nodes_table
from proxy.request.errors import NotReady
from proxy.request.headers import router_client
from proxy.request.rewrite import client_key
from proxy.upstream import UpstreamCallError


def flight(phase: Phase, *, kind: Kind = Kind.CHAT, est_new: int | None = None, fed: int = 0,
           prompt: int | None = None, done: int | None = None) -> Flight:
    f = Flight(id=f"r{id(object())}", kind=kind, method="POST", endpoint="/v1/chat/completions",
               wall_start=0.0, config_gen=1, timer=RequestTimer(arrived=0.0))
    f.phase = phase
    f.prefill.est_new_tokens, f.prefill.fed_tokens = est_new, fed
    f.prompt_tokens, f.prefill_done_tokens = prompt, done
    return f


class TestRule1EveryRequestInFlightCountsOne:
    def test_running_and_arriving_requests_count_one_each(self) -> None:
        load = node_load([flight(Phase.DECODING), flight(Phase.PREFILLING), flight(Phase.ARRIVED)],
                         2000)
        assert (load.running, load.arriving, load.load) == (2, 1, 3)

    def test_only_generating_requests_count(self) -> None:
        load = node_load([flight(Phase.WAITING, kind=Kind.OTHER), flight(Phase.DECODING,
                                                                         kind=Kind.EMBEDDINGS)], 2000)
        assert load.load == 0

    def test_an_idle_node_is_zero(self) -> None:
        assert node_load([], 2000).load == 0


class TestRule2AWaitingRequestCountsOneMore:
    def test_held_and_queued_requests_count_twice(self) -> None:
        load = node_load([flight(Phase.HELD), flight(Phase.QUEUED)], 2000)
        assert (load.held, load.queued, load.waiting, load.requests) == (1, 1, 2, 2)
        assert load.load == 4


class TestRule3ColdTokensCountPerUnit:
    def test_a_held_cold_prompt_weighs_by_its_estimate_less_its_pieces(self) -> None:
        held = flight(Phase.HELD, est_new=5000, fed=1000)
        assert pending_tokens(held) == 4000
        assert node_load([held], 2000).load == 1 + 1 + 2

    def test_a_prefill_counts_down_with_its_progress(self) -> None:
        running = flight(Phase.PREFILLING, est_new=9000, prompt=10_000, done=7000)
        assert pending_tokens(running) == 3000
        assert node_load([running], 2000).load == 1 + 2  # 3000 tokens round up to 2 units

    def test_decoding_requests_and_unestimated_ones_have_none(self) -> None:
        assert pending_tokens(flight(Phase.DECODING, est_new=5000)) == 0
        assert pending_tokens(flight(Phase.QUEUED)) == 0

    def test_the_unit_is_prefill_cold_tokens(self) -> None:
        assert NodeLoad(cold_tokens=1, unit_tokens=500).load == 1
        assert NodeLoad(cold_tokens=1001, unit_tokens=500).load == 3


def test_both_routers_formats() -> None:
    load = NodeLoad(held=1, running=2, cold_tokens=2500, unit_tokens=1000)
    body = vllm_body(load, "node1")
    assert body["load"] == 3 + 1 + 3 and body["node"] == "node1" and body["held"] == 1
    assert sglang_body(load) == [{"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1,
                                  "num_tokens": 7000}]


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    async def tokenize_request(self, kind: str, body: Any, limit: int | None = None) -> list[int]:
        self.calls += 1
        return [1, 2, len(body["messages"])]


class NoProps:
    """An upstream whose /props does not answer (the slot's size stays unknown)."""

    async def get_json(self, path: str, *, timeout_s: float) -> Any:
        raise UpstreamCallError(f"GET {path} failed")


async def test_the_estimator_tokenizes_a_rendered_body_once() -> None:
    estimator = Estimator(NoProps())  # type: ignore[arg-type]
    tokenizer = CountingTokenizer()
    estimator._server_tokenizer = tokenizer  # type: ignore[assignment]
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    config = PrefillConfig()
    rendered = await estimator.prompt_ids(config, "chat", body)
    forwarded = await estimator.prompt_ids(config, "chat", {**body, "return_progress": True})
    assert rendered == forwarded == [1, 2, 1]
    assert tokenizer.calls == 1


def test_render_errors_say_whose_problem_it_is() -> None:
    assert render_error(NotEstimable("a multimodal prompt")).status == 400
    down = EstimateError("no answer")
    down.__cause__ = UpstreamCallError("POST /tokenize failed: refused")
    assert isinstance(render_error(down), NotReady) and render_error(down).status == 503
    bad = EstimateError("bad body")
    bad.__cause__ = UpstreamCallError("answered HTTP 400", status=400)
    assert render_error(bad).status == 400


def test_render_is_not_ready_only_when_the_server_did_not_answer() -> None:
    """A body the server fails on (llama-server answers 500 for a template it cannot apply) is the
    client's problem: a 503 would make a router's breaker take the node out."""
    def caused_by(status: int | None) -> EstimateError:
        exc = EstimateError("http://10.0.0.5:8080/apply-template ...")
        exc.__cause__ = UpstreamCallError("POST http://10.0.0.5:8080/apply-template answered",
                                          status=status, public="POST /apply-template answered")
        return exc

    assert [render_error(caused_by(s)).status for s in (None, 503, 500, 400, 200)] == \
        [503, 503, 400, 400, 400]
    for status in (None, 500):
        message = render_error(caused_by(status)).message
        assert "/apply-template" in message and "10.0.0.5" not in message


def test_the_client_falls_back_to_the_routers_keys_last() -> None:
    assert router_client({"X-Session-Id": "s1", "X-User-Id": "u1"}) == "u1"
    assert router_client({"X-Session-Id": "s1"}) == "s1"
    assert router_client({}) is None
    # X-Slotwise-Client and the body's user come first: a router in front changes no record.
    body = {"user": "alice"}
    assert (client_key(body, None) or router_client({"X-User-Id": "u1"})) == "alice"
    assert (client_key({}, "app") or router_client({"X-User-Id": "u1"})) == "app"


def test_the_cluster_config() -> None:
    config = parse_config({"cluster": {"node": "gpu-1", "load_format": "sglang"},
                           "listen": {"port": 9000}})
    assert node_name(config) == "gpu-1" and config.cluster.load_format == "sglang"
    assert node_name(parse_config({"listen": {"port": 9000}})).endswith(":9000")
    with pytest.raises(ConfigError, match=r"cluster.load_format: unknown load_format 'haproxy' "
                                          r"\(valid: vllm, sglang\)"):
        parse_config({"cluster": {"load_format": "haproxy"}})
    with pytest.raises(ConfigError, match=r"cluster\.node: 'gpu 1' is not a name for a header"):
        parse_config({"cluster": {"node": "gpu 1"}})


def record(rid: str, node: str | None, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "start": "2026-01-01T00:00:00.000+00:00", "kind": "chat", "outcome": "done",
            "stream": True, "ttft_ms": 10.0, "timings": {"prompt_n": 10, "cache_n": 90},
            **({"node": node} if node else {}), **extra}


def test_records_are_grouped_by_their_node_else_their_log() -> None:
    groups = group_by_node([("a.jsonl", [record("1", "n1"), record("2", None)]),
                            ("b.jsonl", [record("3", "n2")])])
    assert {k: [r["id"] for r in v] for k, v in groups.items()} == {"n1": ["1"], "a.jsonl": ["2"],
                                                                    "n2": ["3"]}
    table = nodes_table(groups)
    total = table.rows[-1]
    assert total.label == "all nodes" and total.n == 3 and total.values[-1] == pytest.approx(90.0)


def test_report_over_several_logs_counts_every_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = []
    for node, ids in (("n1", "abc"), ("n2", "de")):
        path = tmp_path / f"{node}.jsonl"
        path.write_bytes(b"".join(orjson.dumps(record(i, node)) + b"\n" for i in ids))
        paths.append(str(path))
    assert main(["report", *paths, "--format", "json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    text = orjson.dumps(out).decode()
    assert '"all nodes"' in text and '"n1"' in text and '"n2"' in text
    assert main(["report", *paths]) == 0
    printed = capsys.readouterr().out
    assert "Requests by node" in printed
    nodes_line = [line for line in printed.splitlines() if line.strip().startswith("all nodes")]
    assert nodes_line and nodes_line[0].split()[2] == "5"


def test_analyze_log_over_several_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    excerpt = Path(__file__).parent / "data" / "server-excerpt.log"
    logs = []
    for node in ("n1", "n2"):
        (tmp_path / node).mkdir()
        path = tmp_path / node / "llama-server.log"
        path.write_bytes(excerpt.read_bytes())
        logs.append(str(path))
    assert main(["analyze-log", *logs, "--format", "json"]) == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["compare"] == ["all nodes", "n1/llama-server.log", "n2/llama-server.log"]
    (nodes,) = [t for t in out["reports"][0]["tables"] if t["key"] == "nodes"]
    tasks = [row["n"] for row in nodes["rows"]]
    assert tasks[0] == tasks[1] > 0 and tasks[2] == 2 * tasks[0]
    assert main(["analyze-log", *logs, "--timing", logs[0]]) == 1
    assert "give one timing log per server log" in capsys.readouterr().err
