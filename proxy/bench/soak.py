"""`slotwise bench soak`: mixed traffic through a `slotwise serve` process in front of a fake
llama-server for a while, then the two things that must hold: one timing record per request sent
(also for clients that were slow, left or sent garbage, and requests that met upstream faults), and
memory that levels off (the process's RSS at the start, middle and end).

Half the clients go through every behaviour, the other half send quick requests back to back, and
a long stream is always open (one after another, `LONG_S` each), so the others' prefills overlap
it and its record lists them all: memory must level off all the same. The test suite
runs it for tens of seconds (tests/test_soak.py); the command runs it longer.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.bench.soak_clients import Clients, Limits, Tally
from proxy.bench.soak_upstream import GAPS_S, make_app
from proxy.record.refusals import requests_in
from proxy.testbed.slotwise import SlotwiseProcess

LIMITS = Limits(header_timeout_s=1.0, body_timeout_s=1.0)
LONG_S = 5.0
"""How long each of the long streams lasts."""
CYCLE = ("stream", "plain", "leaver", "stream", "slow-reader", "upstream-reset", "slow-stream",
         "bad-json", "stream", "upstream-garbled", "plain", "idle-socket", "leaver",
         "upstream-error", "stream", "drip-body", "slow-stream", "upstream-silent", "plain",
         "drip-head")
"""The order a mixed client goes through the behaviours (each one starts at another place)."""
BUSY = ("stream", "plain", "stream", "upstream-error", "stream", "leaver", "plain", "stream")
"""The order a busy client goes through its behaviours: quick requests, back to back."""


@dataclass
class SoakFigures:
    seconds: float
    sent: int
    """Requests whose head reached slotwise."""
    records: int
    """The requests the timing log stands for (a summary of refusals counts its `refused_count`)."""
    requests: dict[str, int]
    outcomes: dict[str, int]
    silent_sockets: int
    silent_closed: int
    unexpected_count: int
    unexpected: list[str]
    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the start, the slotwise process's RSS in MB), once a second."""

    @property
    def lost(self) -> int:
        return self.sent - self.records

    def rss_at(self, share: float) -> float:
        """The RSS sample nearest `share` (0..1) of the run."""
        if not self.rss_mb:
            return 0.0
        target = share * self.seconds
        return min(self.rss_mb, key=lambda sample: abs(sample[0] - target))[1]

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(lost=self.lost, rss_start_mb=self.rss_at(0.0), rss_middle_mb=self.rss_at(0.5),
                    rss_end_mb=self.rss_at(1.0))
        return data


def run(seconds: float, *, clients: int = 12, work_dir: Path | None = None) -> SoakFigures:
    """Soak a `slotwise serve` process for `seconds` with `clients` concurrent clients."""
    if work_dir is None:
        work_dir = Path(tempfile.mkdtemp(prefix="slotwise-soak-"))
    return asyncio.run(_soak(seconds, clients, work_dir))


async def _soak(seconds: float, clients: int, work_dir: Path) -> SoakFigures:
    runner = web.AppRunner(make_app(), access_log=None, handler_cancellation=True,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    upstream = f"http://127.0.0.1:{runner.addresses[0][1]}"
    proxy = SlotwiseProcess(
        upstream, work_dir, upstream={"url": upstream, "read_timeout_s": 1.0},
        listen={"port": 0, "header_timeout_s": LIMITS.header_timeout_s,
                "body_timeout_s": LIMITS.body_timeout_s, "keepalive_timeout_s": 2.0,
                "shutdown_grace_s": 5.0},
        log={"timing": str(work_dir / "timing.jsonl"), "level": "info"})
    try:
        await asyncio.to_thread(proxy.start)
        tally, rss = await _traffic(proxy, seconds, clients)
    finally:
        await asyncio.to_thread(proxy.stop)
        await runner.cleanup()
    records = proxy.records()
    outcomes: Counter[str] = Counter()
    for record in records:  # a summary of refusals stands for its count (docs/record.md)
        outcomes[str(record.get("outcome"))] += requests_in(record)
    return SoakFigures(
        seconds=seconds, sent=tally.sent, records=outcomes.total(), requests=dict(tally.requests),
        outcomes=dict(outcomes),
        silent_sockets=tally.silent_sockets, silent_closed=tally.silent_closed,
        unexpected_count=tally.unexpected_count, unexpected=tally.unexpected, rss_mb=rss)


async def _traffic(proxy: SlotwiseProcess, seconds: float, count: int
                   ) -> tuple[Tally, list[tuple[float, float]]]:
    tally = Tally()
    # Kept-alive connections go before slotwise's keepalive_timeout_s (2 s) would close them.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=1.0)
    async with aiohttp.ClientSession(connector=connector) as session:
        clients = Clients(proxy.url, session, LIMITS)
        started = time.monotonic()
        deadline = started + seconds
        long_streams = asyncio.create_task(_long_streams(clients, tally, deadline))
        workers = [asyncio.create_task(_client(clients, BUSY if i % 2 else CYCLE, tally, i, deadline))
                   for i in range(count)]
        rss = await _sample_rss(proxy.pid, started, deadline)
        await asyncio.gather(*workers, long_streams)
    return tally, rss


async def _long_streams(clients: Clients, tally: Tally, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            await clients.long_stream(tally, int(LONG_S / GAPS_S["long"]))
        except (aiohttp.ClientError, OSError) as exc:
            tally.wrong("long-stream", f"{type(exc).__name__}: {exc}")


async def _client(clients: Clients, cycle: tuple[str, ...], tally: Tally, index: int,
                  deadline: float) -> None:
    order = itertools.islice(itertools.cycle(cycle), index * 7 % len(cycle), None)
    for behaviour in order:
        if time.monotonic() >= deadline:
            return
        try:
            await clients.behaviours[behaviour](tally)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            tally.wrong(behaviour, f"{type(exc).__name__}: {exc}")


async def _sample_rss(pid: int, started: float, deadline: float) -> list[tuple[float, float]]:
    samples = []
    while (now := time.monotonic()) < deadline:
        samples.append((round(now - started, 1), rss_mb(pid)))
        await asyncio.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
    samples.append((round(time.monotonic() - started, 1), rss_mb(pid)))
    return samples


def rss_mb(pid: int) -> float:
    """A process's resident set size in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
