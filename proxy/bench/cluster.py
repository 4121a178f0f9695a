"""`slotwise bench cluster`: what cache-aware routing costs a request. Two testbed nodes (llama-server
+ slotwise each) behind two vllm-routers at once, one `cache_aware` (it asks every node's /render
before it routes) and one `consistent_hash` (it routes on a hash, no call); each new turn goes
through both in alternating order, so drift cancels out. The figure: the median of the paired
differences in time to first token (aim: at most 5 ms), and what one /render costs on a node.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from proxy.bench.harness import temp_dir, timed_stream
from proxy.bench.output import figures_table, show
from proxy.testbed.args import positive_int
from proxy.testbed.cluster import Cluster
from proxy.testbed.words import filler

AIM_ADDED_MS = 5.0


@dataclass
class ClusterFigures:
    ttft_hash_ms: float
    ttft_cache_aware_ms: float
    ttft_added_ms: float
    """Median of the paired differences, cache_aware - consistent_hash."""
    render_ms: float
    """Median time of one POST /v1/chat/completions/render of a new body on a node, as a client
    sees it (the ids cache cannot help: the body is new)."""
    pairs: int
    prompt_words: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def conversation(i: int, prompt_words: int, turn: int = 0) -> dict[str, Any]:
    """Conversation `i % 4` (its long system prompt cached on its node) at a new turn: a body no
    node has rendered before, as every real request is."""
    system = f"Conversation {i % 4}. " + filler(random.Random(i % 4), prompt_words)
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Say something about the weather ({turn})."}],
            "stream": True, "max_tokens": 2, "temperature": 0}


async def _ttft(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    result = await timed_stream(session, url, body)
    if result.ttft is None:
        raise RuntimeError(f"no token came back from {url} (status {result.status})")
    return result.ttft * 1000.0


async def _render_ms(session: aiohttp.ClientSession, node: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    async with session.post(node + "/v1/chat/completions/render", json=body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{node} answered /render with HTTP {response.status}")
    return (time.perf_counter() - started) * 1000.0


async def measure(cache_aware: str, hashed: str, node: str, pairs: int,
                  prompt_words: int) -> ClusterFigures:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for i in range(4):  # every system prompt cached on the nodes both routers pick
            for url in (cache_aware, hashed, cache_aware, hashed):
                await _ttft(session, url, conversation(i, prompt_words))
        a, b, diffs = [], [], []
        for i in range(pairs):
            body = conversation(i, prompt_words, turn=i + 1)
            order = (cache_aware, hashed) if i % 2 == 0 else (hashed, cache_aware)
            first, second = await _ttft(session, order[0], body), await _ttft(session, order[1], body)
            aware, plain = (first, second) if order[0] == cache_aware else (second, first)
            a.append(aware)
            b.append(plain)
            diffs.append(aware - plain)
        renders = [await _render_ms(session, node, conversation(i, prompt_words, turn=pairs + i + 1))
                   for i in range(pairs)]
    return ClusterFigures(statistics.median(b), statistics.median(a), statistics.median(diffs),
                          statistics.median(renders), pairs, prompt_words)


def run(pairs: int, prompt_words: int, work_dir: Path | None = None) -> ClusterFigures:
    where = work_dir or temp_dir("slotwise-bench-cluster-")
    # each slot holds a conversation of `pairs` turns of `prompt_words` words (~5 tokens a word)
    slot_ctx = max(2048, (prompt_words * 6 + 256) // 256 * 256 * 2)
    with Cluster(2, where, policy="cache_aware",
                 server_args=("-np", "4", "-c", str(4 * slot_ctx))) as cluster:
        cluster.add_router("consistent_hash")
        aware, hashed = cluster.routers[0].url, cluster.routers[1].url
        return asyncio.run(measure(aware, hashed, cluster.nodes[0].url, pairs, prompt_words))


def add_cluster(commands: Any) -> None:
    bench = commands.add_parser(
        "cluster", help="time to first token through vllm-router: cache_aware (/render) versus "
        "consistent_hash, two testbed nodes")
    bench.add_argument("--pairs", type=positive_int, default=40,
                       help="requests through each router (default 40)")
    bench.add_argument("--words", type=positive_int, default=600,
                       help="words in each conversation's system prompt (default 600)")
    bench.add_argument("--json", action="store_true", help="also print the figures as JSON")
    bench.set_defaults(handler=run_cluster)


def run_cluster(args: Any) -> int:
    Console(stderr=True).print("[dim]starting 2 nodes (llama-server + slotwise) and two "
                               "vllm-routers …[/dim]")
    figures = run(args.pairs, args.words)
    return show(cluster_table(figures), figures.as_dict(), as_json=args.json)


def cluster_table(figures: ClusterFigures) -> Table:
    table = figures_table(f"cache-aware routing's cost (testbed tiny model, 2 nodes, "
                          f"{figures.pairs} pairs, one run)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("note")
    table.add_row("time to first token, median, consistent_hash", f"{figures.ttft_hash_ms:.2f} ms",
                  "the router hashes; no call to the nodes")
    table.add_row("time to first token, median, cache_aware", f"{figures.ttft_cache_aware_ms:.2f} ms",
                  "the router asks both nodes' /render first")
    verdict = "ok" if figures.ttft_added_ms <= AIM_ADDED_MS else "over the aim"
    table.add_row("added by /render (median of paired differences)",
                  f"{figures.ttft_added_ms:+.2f} ms", f"aim ≤ {AIM_ADDED_MS:g} ms: {verdict}")
    table.add_row("one /render of a new body on a node, median", f"{figures.render_ms:.2f} ms",
                  f"{figures.prompt_words} words of system prompt; the request's own estimate "
                  "is then a lookup in the ids cache")
    return table
