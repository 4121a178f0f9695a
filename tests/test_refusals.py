"""Refused requests' records, bounded (`proxy/record/refusals.py`): one class per rule of
`RefusalSampler`, plain values in; then one client's flood of refusals through a proxy: a few
records whole, one summary, and every request still counted (`requests_in`, /metrics)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.record.kind import Kind
from proxy.record.refusals import (
    OTHER_PEERS,
    RefusalKey,
    RefusalSampler,
    Summary,
    requests_in,
    summary_record,
)
from proxy.record.schema import Record
from proxy.report.nodes import nodes_table
from proxy.report.records import load_timing_log
from proxy.report.reports import timing_report
from proxy.report.tables import Thresholds
from tests.conftest import StartProxy
from tests.helpers import read_records


def refused(outcome: str = "unauthorized", status: int = 401, start: str = "t0") -> Record:
    return Record(id="r", start=start, outcome=outcome, status=status, config_gen=3, node="n:1")


def written(sampler: RefusalSampler, record: Record, peer: str, times: int, now: float = 0.0) -> int:
    return sum(sampler.admit(record, peer, now) for _ in range(times))


class TestRule1OnlyRefusalsAreSampled:
    @pytest.mark.parametrize("outcome", ["done", "upstream_error", "client_gone", "rejected",
                                         "proxy_error", "shutdown"])
    def test_every_other_record_is_written(self, outcome: str) -> None:
        sampler = RefusalSampler(whole=1)
        assert written(sampler, refused(outcome, 200), "1.2.3.4", 100) == 100
        assert sampler.flush() == [] and len(sampler) == 0


class TestRule2TheFirstFewOfAMinuteAreWrittenWhole:
    def test_the_first_whole_per_key_then_none(self) -> None:
        sampler = RefusalSampler(whole=5)
        assert written(sampler, refused(), "1.2.3.4", 50) == 5
        assert written(sampler, refused(), "5.6.7.8", 50) == 5  # another peer: its own key
        assert written(sampler, refused("forbidden", 403), "1.2.3.4", 50) == 5  # another reason
        assert written(sampler, refused("bad_request", 413), "1.2.3.4", 3) == 3
        assert written(sampler, refused("bad_request", 400), "1.2.3.4", 9) == 5  # another status

    def test_a_key_starts_anew_once_its_minute_is_over(self) -> None:
        sampler = RefusalSampler(whole=2, window_s=60.0)
        assert written(sampler, refused(), "p", 10, now=0.0) == 2
        assert written(sampler, refused(), "p", 10, now=59.0) == 0
        sampler.due(60.0)
        assert written(sampler, refused(), "p", 10, now=60.5) == 2


class TestRule3TheRestAreCountedInOneSummary:
    def test_one_summary_per_key_when_its_minute_is_over(self) -> None:
        sampler = RefusalSampler(whole=5, window_s=60.0)
        written(sampler, refused(start="t0"), "1.2.3.4", 50, now=10.0)
        written(sampler, refused("forbidden", 403), "1.2.3.4", 3, now=20.0)  # none held back
        assert sampler.due(69.0) == []
        (summary,) = sampler.due(70.0)
        assert summary == Summary(RefusalKey("1.2.3.4", "unauthorized", 401), "t0", 45, 3, "n:1")
        assert sampler.due(80.0) == [] and len(sampler) == 0  # the other minute left nothing
        assert sampler.not_written == {"unauthorized": 45}

    def test_the_summary_is_a_record_of_its_own_kind_standing_for_its_count(self) -> None:
        summary = Summary(RefusalKey("1.2.3.4", "unauthorized", 401), "t0", 45, 3, "n:1")
        record = summary_record(summary, "abc")
        assert (record.kind, record.refused_count, record.peer) == (Kind.REFUSALS, 45, "1.2.3.4")
        assert (record.status, record.outcome, record.start, record.node) == (401, "unauthorized",
                                                                              "t0", "n:1")
        assert "45 more requests from 1.2.3.4" in (record.error or "")
        assert requests_in(record.to_dict()) == 45 and requests_in(refused().to_dict()) == 1

    def test_flush_gives_every_summary_at_once(self) -> None:
        sampler = RefusalSampler(whole=1)
        written(sampler, refused(), "a", 3)
        written(sampler, refused(), "b", 2)
        assert sorted((s.key.peer, s.count) for s in sampler.flush()) == [("a", 2), ("b", 1)]


class TestRule4KeysAreBounded:
    def test_past_max_keys_new_peers_share_one_key(self) -> None:
        sampler = RefusalSampler(whole=1, max_keys=3)
        for peer in ("a", "b", "c"):
            written(sampler, refused(), peer, 2)
        assert written(sampler, refused(), "d", 1) == 1  # the first of "(other peers)"
        assert written(sampler, refused(), "e", 5) == 0
        assert len(sampler) == 4
        summaries = {s.key.peer: s.count for s in sampler.flush()}
        assert summaries == {"a": 1, "b": 1, "c": 1, OTHER_PEERS: 5}


async def test_a_flood_of_refusals_writes_a_few_records_and_one_summary(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, access={"clients": [{"name": "alice", "key": "alice-key"}],
                                          "pages_token": "page-token"})
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            async with session.post(proxy.url + "/v1/chat/completions", json=body) as response:
                assert response.status == 401
        headers = {"Authorization": "Bearer alice-key"}
        async with session.post(proxy.url + "/v1/chat/completions", json=body,
                                headers=headers) as response:
            assert response.status == 200
        async with session.get(proxy.url + "/metrics",
                               headers={"Authorization": "Bearer page-token"}) as response:
            metrics = await response.text()
    assert 'slotwise_refusals_not_recorded_total{outcome="unauthorized"} 45.0' in metrics
    assert 'slotwise_requests_total{endpoint="chat",outcome="unauthorized",purpose="none"} 50.0' \
        in metrics
    assert len(read_records(proxy, 6)) == 6  # 5 refusals whole, the answered one
    await asyncio.to_thread(proxy.stop)  # the summary of a minute not over is written at the stop
    records = read_records(proxy)
    assert [r["kind"] for r in records] == ["chat"] * 6 + [Kind.REFUSALS]
    summary = records[-1]
    assert (summary["refused_count"], summary["peer"], summary["status"]) == (45, "127.0.0.1", 401)
    assert sum(requests_in(r) for r in records) == 51


def test_the_report_counts_the_requests_a_summary_stands_for(tmp_path: Path) -> None:
    start = "2025-01-01T00:00:00.000+00:00"
    whole = Record(id="a", start=start, kind="chat", method="POST", endpoint="/v1/chat/completions",
                   status=401, outcome="unauthorized")
    summary = summary_record(Summary(RefusalKey("1.2.3.4", "unauthorized", 401), start, 45, 1, "n"),
                             "s")
    path = tmp_path / "timing.jsonl"
    path.write_bytes(whole.to_json() + summary.to_json())
    log = load_timing_log(str(path))
    report = timing_report("log", list(log.records), log, Thresholds())
    rows = {(t.key, r.label): r.n for t in report.tables for r in t.rows}
    assert rows[("overview", "requests")] == 46  # the summary has no times: no span of its own
    assert rows[("requests", "requests")] == rows[("requests", "outcome unauthorized")] == 46
    (node, _) = nodes_table({"n": list(log.records)}).rows  # several logs: the row of each node
    assert node.n == 46
