"""`slotwise bench overhead`: what the proxy adds, measured against the real testbed server in one
run: time to first token direct versus through slotwise (alternating, so drift cancels out), and how
fast slotwise relays stream events, per second of its own CPU time (one core)."""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bench.harness import StreamResult, temp_dir, timed_stream
from proxy.testbed.model import write_model
from proxy.testbed.server import LlamaServer
from proxy.testbed.slotwise import SlotwiseProcess

PROMPT = [{"role": "user", "content": "Say something about the weather in spring."}]


@dataclass
class OverheadFigures:
    ttft_direct_ms: float
    ttft_proxy_ms: float
    ttft_added_ms: float  # median of the paired differences
    rate_direct: float  # stream events per wall second, direct
    rate_proxy: float  # the same through slotwise
    events_relayed: int
    proxy_cpu_s: float
    events_per_cpu_s: float  # relay capacity of one core

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def _ttft(session: aiohttp.ClientSession, url: str) -> float:
    body = {"messages": PROMPT, "stream": True, "max_tokens": 2, "temperature": 0}
    result = await timed_stream(session, url, body)
    if result.ttft is None:
        raise RuntimeError(f"no token came back from {url} (status {result.status})")
    return result.ttft * 1000.0


async def measure_ttft(direct: str, proxy: str, pairs: int) -> tuple[list[float], list[float]]:
    # A new connection per request on both paths: llama-server closes its end after a stream,
    # so a pooled connection would fail at random on the direct path.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for url in (direct, proxy, direct, proxy):  # warm caches and connections
            await _ttft(session, url)
        a, b = [], []
        for i in range(pairs):
            order = (direct, proxy) if i % 2 == 0 else (proxy, direct)
            first, second = await _ttft(session, order[0]), await _ttft(session, order[1])
            a.append(first if order[0] == direct else second)
            b.append(second if order[0] == direct else first)
        return a, b


async def measure_rate(url: str, streams: int, tokens: int) -> tuple[float, int]:
    """Events per wall second over `streams` concurrent long generations."""
    body = {"messages": PROMPT, "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 1.0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        results: list[StreamResult] = await asyncio.gather(
            *(timed_stream(session, url, body) for _ in range(streams)))
    events = sum(len(r.tokens) for r in results)
    start = min(r.sent for r in results)
    end = max(r.ended or r.sent for r in results)
    return events / (end - start), events


def run(*, pairs: int = 40, streams: int = 8, tokens: int = 1500,
        work_dir: Path | None = None) -> OverheadFigures:
    work = work_dir or temp_dir("slotwise-bench-overhead-")
    model = write_model(work / "model", "tiny", seed=0)
    with LlamaServer(model.model, args=["-np", str(streams), "-c", str(streams * 2048)],
                     log_path=work / "llama-server.log") as server, \
            SlotwiseProcess(server.url, work / "slotwise") as proxy:
        direct_ms, proxy_ms = asyncio.run(measure_ttft(server.url, proxy.url, pairs))
        rate_direct, _ = asyncio.run(measure_rate(server.url, streams, tokens))
        cpu_before = proxy.cpu_seconds()
        rate_proxy, events = asyncio.run(measure_rate(proxy.url, streams, tokens))
        cpu = proxy.cpu_seconds() - cpu_before
    added = [p - d for d, p in zip(direct_ms, proxy_ms, strict=True)]
    return OverheadFigures(
        ttft_direct_ms=statistics.median(direct_ms), ttft_proxy_ms=statistics.median(proxy_ms),
        ttft_added_ms=statistics.median(added), rate_direct=rate_direct, rate_proxy=rate_proxy,
        events_relayed=events, proxy_cpu_s=cpu, events_per_cpu_s=events / cpu if cpu else 0.0)
