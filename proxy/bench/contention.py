"""`slotwise bench contention`: what a cold prompt does to everyone else, in one run on the testbed
small model. Three streams generate; a cold prompt of several thousand tokens arrives; short turns
arrive meanwhile. Paths: direct (default batch), direct with `-b 512`, slotwise `defer`, `chunk`.
Baselines (streams alone, short turns without the cold prompt, the cold prompt alone) per server
setting; every phase runs on a freshly started llama-server.

Every request is named as on every path (`cold`, `short-3`, `user1-4`); each direct path's calls
are kept as timing records (`client-<path>.jsonl`), for `slotwise whatif` (docs/whatif.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bench.calls import Call, client_log, timed_call
from proxy.bench.harness import StreamResult
from proxy.request.headers import CLIENT_HEADER, REQUEST_ID_HEADER
from proxy.testbed.model import write_model
from proxy.testbed.server import LlamaServer
from proxy.testbed.slotwise import SlotwiseProcess
from proxy.testbed.words import filler

SERVER_ARGS = ("-np", "5", "-c", "40960", "--no-cache-idle-slots")
"""The set-up docs/prefill.md recommends: slots with their own KV (explicit -np), one more than the
streams plus the cold prompt's slot, idle slots not copied to RAM after every task launch."""


@dataclass(frozen=True)
class Scenario:
    streams: int = 3
    """Requests generating when the cold prompt arrives."""
    stream_tokens: int = 1200
    """Tokens each stream generates (they must outlive the chunked cold prompt)."""
    chat_turns: bool = False
    """Each stream is a user chatting: turn after turn of `stream_tokens` tokens, a pause of
    `pause_s` between them, until the cold request has its first token (the field report's users)."""
    pause_s: tuple[float, float] = (0.5, 2.0)
    calm_s: float = 20.0
    """`chat_turns`: how long the users chat in the baseline without a cold prompt."""
    cold_words: int = 700
    """Size of the cold history in words (the record shows its tokens)."""
    lead_s: float = 1.5
    """The streams run alone this long before the cold prompt arrives."""
    shorts: int = 12
    short_every_s: float = 0.5
    """Mean interval between short turns."""
    arrivals: str = "random"
    """`random`: each short turn arrives at a random moment of its own `short_every_s` window
    (seeded: the same times on every path), so arrivals fall at any phase of the pieces' rhythm
    without piling up; `periodic`: exactly every `short_every_s`, which can lock into step with
    the pieces' rhythm and make the short turns' figures a matter of phase."""
    arrival_seed: int = 7

    def short_offsets(self) -> list[float]:
        """When each short turn arrives, in seconds after the cold prompt."""
        if self.arrivals == "periodic":
            return [0.3 + i * self.short_every_s for i in range(self.shorts)]
        if self.arrivals != "random":
            raise ValueError(f"arrivals must be 'random' or 'periodic', got {self.arrivals!r}")
        rng = random.Random(self.arrival_seed)
        return [0.3 + (i + rng.random()) * self.short_every_s for i in range(self.shorts)]


@dataclass
class Run:
    """What one path measured: the three streams, the short turns, the cold request."""

    streams: list[StreamResult]
    shorts: list[StreamResult]
    cold: StreamResult | None
    started: float
    ended: float
    records: list[dict[str, Any]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    """Every request as its client saw it, with its id and client."""
    wall_offset: float = 0.0
    """Unix time less the client's monotonic clock (for the records' `start`)."""

    def window(self) -> tuple[float, float] | None:
        """While the cold prompt was in the system: its arrival to its first token."""
        if self.cold is None or not self.cold.tokens:
            return None
        return self.cold.sent, self.cold.tokens[0]


def history(words: int, seed: int) -> list[dict[str, str]]:
    """A long chat history, different for every seed (so it is cold on every path)."""
    rng = random.Random(seed)
    turns = [{"role": "system", "content": f"Session {seed}: {rng.random()}"}]
    for i in range(max(2, words // 60)):
        text = filler(rng, 60)
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    turns.append({"role": "user", "content": "So, where were we?"})
    return turns


def _chat(messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    return {"messages": messages, "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0.8}


def _short(tag: str, i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{tag} {i}: thanks! One word, yes or no?"}]


async def _later(delay: float, make: Callable[[], Awaitable[StreamResult]]) -> StreamResult:
    await asyncio.sleep(delay)
    return await make()


@dataclass
class _Client:
    """Sends the scenario's requests, named in their headers, and keeps each one (`timed_call`)."""

    session: aiohttp.ClientSession
    url: str
    calls: list[Call] = field(default_factory=list)

    async def send(self, who: str, request_id: str, body: dict[str, Any]) -> StreamResult:
        call = await timed_call(self.session, self.url, body,
                                {CLIENT_HEADER: who, REQUEST_ID_HEADER: request_id}, self.calls,
                                request_id=request_id, who=who, act="chat", purpose="chat")
        if not call.ok:
            raise RuntimeError(f"{request_id} failed (HTTP {call.result.status or 'none'}): "
                               f"the run's figures would be of fewer requests")
        return call.result

    def stream(self, who: str, request_id: str, body: dict[str, Any]
               ) -> Callable[[], Awaitable[StreamResult]]:
        return lambda: self.send(who, request_id, body)


async def play(url: str, sc: Scenario, tag: str, *, cold_seed: int | None,
               with_streams: bool = True) -> Run:
    """One scenario against `url`: the streams, the cold prompt (unless None), the short turns."""
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = _Client(session, url)
        loop = asyncio.get_running_loop()
        started = loop.time()
        stop = asyncio.Event()
        users = [asyncio.create_task(_user(client, sc, f"user{i}", f"{tag} stream {i}", 0.05 * i,
                                           stop))
                 for i in range(sc.streams if with_streams else 0)]
        lead = sc.lead_s if with_streams else 0.0
        cold = (asyncio.create_task(_later(lead, client.stream(
                    "returning", "cold", _chat(history(sc.cold_words, cold_seed), 8))))
                if cold_seed is not None else None)
        shorts = [asyncio.create_task(_later(lead + offset, client.stream(
                      f"short-{i}", f"short-{i}", _chat(_short(tag, i), 4))))
                  for i, offset in enumerate(sc.short_offsets() if with_streams else [])]
        if cold is not None:
            done_cold: StreamResult | None = await cold
        else:
            done_cold = None
            await asyncio.sleep(sc.calm_s if sc.chat_turns else 0.0)
        stop.set()  # chatting users end their current turn and stop
        done_streams = [turn for turns in await asyncio.gather(*users) for turn in turns]
        done_shorts = list(await asyncio.gather(*shorts))
        return Run(done_streams, done_shorts, done_cold, started, loop.time(),
                   calls=client.calls, wall_offset=time.time() - time.monotonic())


async def _user(client: _Client, sc: Scenario, who: str, text: str, delay: float,
                stop: asyncio.Event) -> list[StreamResult]:
    """One generating user: one long stream, or (`chat_turns`) turns with pauses until `stop`."""
    await asyncio.sleep(delay)
    body = _chat([{"role": "user", "content": f"{text}: tell me a long story."}], sc.stream_tokens)
    if not sc.chat_turns:
        return [await client.send(who, f"{who}-0", body)]
    rng = random.Random(who)  # the same pauses on every path
    turns: list[StreamResult] = []
    while not stop.is_set():
        turns.append(await client.send(who, f"{who}-{len(turns)}", body))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(*sc.pause_s))
    return turns


def decode_rate(results: Sequence[StreamResult], lo: float | None = None,
                hi: float | None = None) -> float | None:
    """Token events per second of decoding within [lo, hi], pooled over `results` (each one's
    own decode, first to last token, clipped to the window): what a user reading a reply sees."""
    events, span = 0, 0.0
    for result in results:
        if len(result.tokens) < 2:
            continue
        a = max(lo if lo is not None else result.tokens[0], result.tokens[0])
        b = min(hi if hi is not None else result.tokens[-1], result.tokens[-1])
        if b > a:
            events += sum(1 for t in result.tokens if a < t <= b)
            span += b - a
    return events / span if span >= 0.3 else None


def max_gap(result: StreamResult) -> float | None:
    gaps = [b - a for a, b in zip(result.tokens, result.tokens[1:], strict=False)]
    return max(gaps) if gaps else None


def pct(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))
    return ordered[int(rank) - 1]


@dataclass
class Baseline:
    stream_rate: float
    """Mean tokens/s of each of three streams generating together, no cold prompt."""
    short_ttft: list[float]
    cold_ttft: float
    """The cold prompt's TTFT alone: the median of `cold_alone`."""
    cold_prompt_tokens: int | None = None
    cold_alone: tuple[float, ...] = ()
    """Each timing of the cold prompt alone (ALONE_RUNS)."""


async def calm_baseline(url: str, sc: Scenario, seed: int) -> tuple[float, list[float]]:
    """The streams' mean rate and the short turns' TTFTs with no cold prompt."""
    calm = await play(url, sc, f"calm{seed}", cold_seed=None)
    rate = decode_rate(calm.streams)
    assert rate is not None, "the streams generated nothing"
    return rate, [s.ttft for s in calm.shorts if s.ttft is not None]


async def alone_baseline(url: str, sc: Scenario, seed: int) -> float:
    """The cold prompt's TTFT with nothing else running."""
    alone = await play(url, sc, f"alone{seed}", cold_seed=seed, with_streams=False)
    assert alone.cold is not None and alone.cold.ttft is not None, "the cold prompt got no token"
    return alone.cold.ttft


async def through(url: str, work: Path, mode: str, sc: Scenario, seed: int,
                  prefill: dict[str, Any]) -> Run:
    with SlotwiseProcess(url, work / f"slotwise-{mode}",
                         prefill={"mode": mode, **prefill}) as proxy:
        run = await play(proxy.url, sc, mode, cold_seed=seed)
    run.records = proxy.records()
    return run


ALONE_RUNS = 3
"""The cold prompt alone is timed this many times, each on a fresh server, and the median kept:
every path's `cold ×` divides by it. Timed once, it swung from 4.05 to 6.86 s between set-ups of
one run on a two-core machine whose speed halved now and then for seconds (a 128-token piece 1.0
then 2.2 ms a token in one phase), and `share + 1/cold×` with it."""


PATHS = ("direct", "defer", "chunk", "b512")
"""Short names of the paths, for `--paths`."""


def measure(model_dir: Path, work: Path, sc: Scenario, prefill: dict[str, Any],
            paths: Sequence[str] = PATHS, server_args: Sequence[str] = SERVER_ARGS,
            binary: Path | None = None, log: Callable[[str], None] = print,
            beside: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
            ) -> tuple[dict[str, Run], dict[str, Baseline]]:
    """The chosen paths in one run; returns the runs by path name and each server's baseline.

    Every phase (each baseline, each path) gets a llama-server of its own, started fresh: a slot
    still holding an earlier phase's long prompt is copied to RAM when a new request takes it
    (on the server's main loop, stalling everyone), which would charge one phase for another.
    `beside` runs around every phase, baselines included (a CPU competitor, say)."""
    model = write_model(model_dir, "small", seed=0)
    runs: dict[str, Run] = {}
    bases: dict[str, Baseline] = {}
    servers = (("default", (), [p for p in PATHS[:3] if p in paths]),
               ("b512", ("-b", "512"), [p for p in PATHS[3:] if p in paths]))
    for name, extra, wanted in servers:
        if not wanted:
            continue
        args = [*server_args, *extra]

        @contextlib.contextmanager
        def fresh(phase: str, args: list[str] = args, name: str = name) -> Iterator[LlamaServer]:
            with beside(), LlamaServer(model.model, args=args, binary=binary,
                                       log_path=work / f"llama-server-{name}-{phase}.log") as server:
                yield server

        log(f"llama-server {' '.join(args)}: baselines …")
        seed = 100 + len(bases)
        with fresh("calm") as server:
            rate, shorts = asyncio.run(calm_baseline(server.url, sc, seed))
        alone = []
        for i in range(ALONE_RUNS):
            with fresh("alone" if i == 0 else f"alone{i + 1}") as server:
                alone.append(asyncio.run(alone_baseline(server.url, sc, seed + 50 * i)))
        bases[name] = Baseline(stream_rate=rate, short_ttft=shorts,
                               cold_ttft=statistics.median(alone), cold_alone=tuple(alone))
        for seed, path in enumerate(wanted, start=1 + 10 * len(bases)):
            log(f"{path} …")
            with fresh(path) as server:
                if path in ("defer", "chunk"):
                    runs[f"slotwise {path}"] = asyncio.run(
                        through(server.url, work, path, sc, seed, prefill))
                else:
                    label = "direct -b 512" if path == "b512" else "direct"
                    runs[label] = asyncio.run(play(server.url, sc, path, cold_seed=seed))
                    run = runs[label]
                    (work / f"client-{path}.jsonl").write_bytes(client_log(run.calls,
                                                                           run.wall_offset))
    return runs, bases
