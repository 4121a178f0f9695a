"""`slotwise bench warm`: what a warm-up buys the turn that follows it, and what it costs the others,
in one run on the testbed. Every phase runs on a freshly started llama-server with slotwise in front
(`prefill.mode = chunk`, `[warm]` at its defaults):

- baseline: the turn (a ~3,300-token history and a short message) on an idle server, cold; then a
  turn with the same history and another message, fully cached;
- warmed: the history warmed (`POST /slotwise/warm/...`), the turn sent after as long as the cold
  turn took (the history's time alone), and on another server after half that;
- streams: three streams generating; a short turn; the history warmed; another short turn during the
  warm-up; the streams' rate and longest gap while it ran, against `chunk` feeding the same history
  as a cold turn among the same streams.
The figures say nothing about terminals: `warm_cli.py` prints them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bench.contention import SERVER_ARGS, decode_rate
from proxy.bench.harness import StreamResult, timed_stream
from proxy.testbed.model import write_model
from proxy.testbed.server import LlamaServer
from proxy.testbed.slotwise import SlotwiseProcess
from proxy.testbed.words import filler

WARM_PATH = "/slotwise/warm/v1/chat/completions"
POLL_S = 0.05


@dataclass(frozen=True)
class WarmScenario:
    preset: str = "small"
    history_words: int = 700
    """The history's size in words (700: about 3,300 tokens, the contention benchmark's)."""
    streams: int = 3
    stream_tokens: int = 1200
    """Tokens each stream generates (they must outlive the warm-up)."""
    lead_s: float = 1.5
    """The streams run alone this long before the warm-up (a short turn half way)."""
    short_after_s: float = 0.5
    """The short turn during the warm-up comes this long after it was asked for."""


@dataclass
class Window:
    """The streams' figures while something was computed (the warm-up, or chunk's cold prompt)."""

    seconds: float | None = None
    rate: float | None = None
    """Token events per second, pooled over the streams."""
    longest_gap_s: float | None = None


@dataclass
class WarmFigures:
    history_tokens: int | None = None
    cold_ttft_s: float | None = None
    cached_ttft_s: float | None = None
    warm_full_ttft_s: float | None = None
    warm_half_ttft_s: float | None = None
    warm_full_cached_share: float | None = None
    """The warmed turn's `cache_n` / its prompt tokens (after a full history's time)."""
    warm_full_warmed_tokens: int | None = None
    streams_alone_rate: float | None = None
    during_warm: Window = field(default_factory=Window)
    during_chunk: Window = field(default_factory=Window)
    short_alone_ttft_s: float | None = None
    short_during_warm_ttft_s: float | None = None
    warm_records: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def conversation(words: int, seed: int = 7) -> list[dict[str, str]]:
    """A long chat history ending with the assistant's reply (the turn adds the user's message)."""
    rng = random.Random(seed)
    turns = [{"role": "system", "content": f"Session {seed}: {rng.random()}"}]
    for i in range(max(2, words // 60)):
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": filler(rng, 60)})
    return turns


def turn(history: list[dict[str, str]], text: str, tokens: int = 4) -> dict[str, Any]:
    return {"messages": [*history, {"role": "user", "content": text}], "stream": True,
            "max_tokens": tokens, "ignore_eos": True}


def _short(text: str) -> dict[str, Any]:
    return turn([], text, 4)


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_read=600))


async def post_warm(session: aiohttp.ClientSession, url: str, history: list[dict[str, str]], *,
                    headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    async with session.post(url + WARM_PATH, json={"messages": history},
                            headers=headers) as response:
        body: dict[str, Any] = await response.json()
        if response.status != 202:
            raise RuntimeError(f"POST {WARM_PATH} answered {response.status}: {body}")
        return body


async def until_ended(session: aiohttp.ClientSession, url: str, warm_id: str) -> float:
    """Poll the warm-up until it ended; when it was seen ended (monotonic)."""
    while True:
        async with session.get(f"{url}/slotwise/warm/{warm_id}") as response:
            if (await response.json()).get("state") == "ended":
                return time.monotonic()
        await asyncio.sleep(POLL_S)


async def first_request(url: str) -> None:
    """A fresh llama-server's first request pays for setting itself up; not the phase's."""
    async with await _session() as session:
        await timed_stream(session, url, _short("hello"))


async def baseline(url: str, sc: WarmScenario) -> tuple[StreamResult, StreamResult]:
    history = conversation(sc.history_words)
    async with await _session() as session:
        cold = await timed_stream(session, url, turn(history, "So, where were we?"))
        cached = await timed_stream(session, url, turn(history, "And then what happened?"))
    return cold, cached


async def warmed_turn(url: str, sc: WarmScenario, after_s: float) -> StreamResult:
    """The history warmed, the turn sent `after_s` after the warm-up was asked for."""
    history = conversation(sc.history_words)
    async with await _session() as session:
        asked = time.monotonic()
        await post_warm(session, url, history)
        await asyncio.sleep(max(0.0, asked + after_s - time.monotonic()))
        return await timed_stream(session, url, turn(history, "So, where were we?"))


@dataclass
class StreamsRun:
    streams: list[StreamResult]
    short_alone: StreamResult | None
    short_during: StreamResult | None
    window: tuple[float, float]


async def streams_with(url: str, sc: WarmScenario, *, warm: bool) -> StreamsRun:
    """Streams generating; then the history warmed (`warm`) or sent as a cold turn (chunk)."""
    history = conversation(sc.history_words)
    async with await _session() as session:
        story = {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
                 "max_tokens": sc.stream_tokens, "ignore_eos": True}
        began = time.monotonic()
        streams = [asyncio.create_task(_later(0.05 * i, lambda: timed_stream(session, url, story)))
                   for i in range(sc.streams)]
        short_alone = await _later(sc.lead_s / 2, lambda: timed_stream(
            session, url, _short("alone: one word, yes or no?")))
        await asyncio.sleep(max(0.0, began + sc.lead_s - time.monotonic()))
        start = time.monotonic()
        short_during = None
        if warm:
            answer = await post_warm(session, url, history)
            short_during = await _later(sc.short_after_s, lambda: timed_stream(
                session, url, _short("meanwhile: one word, yes or no?")))
            end = await until_ended(session, url, str(answer["id"]))
        else:
            cold = await timed_stream(session, url, turn(history, "So, where were we?"))
            end = cold.tokens[0] if cold.tokens else time.monotonic()
        done = list(await asyncio.gather(*streams))
    return StreamsRun(done, short_alone, short_during, (start, end))


async def _later(delay: float, make: Callable[[], Awaitable[StreamResult]]) -> StreamResult:
    await asyncio.sleep(delay)
    return await make()


def window_figures(streams: Sequence[StreamResult], lo: float, hi: float) -> Window:
    gaps = [b - a for s in streams for a, b in zip(s.tokens, s.tokens[1:], strict=False)
            if b > lo and a < hi]
    return Window(seconds=hi - lo, rate=decode_rate(streams, lo, hi),
                  longest_gap_s=max(gaps) if gaps else None)


def measure(model_dir: Path, work: Path, sc: WarmScenario, server_args: Sequence[str] = SERVER_ARGS,
            binary: Path | None = None, log: Callable[[str], None] = print) -> WarmFigures:
    """Every phase on a fresh llama-server and slotwise (a slot holding an earlier phase's history
    would make the next phase's turn cached)."""
    model = write_model(model_dir, sc.preset, seed=0)
    figures = WarmFigures()

    @contextlib.contextmanager
    def fresh(phase: str) -> Iterator[SlotwiseProcess]:
        with LlamaServer(model.model, args=list(server_args), binary=binary,
                         log_path=work / f"llama-server-{phase}.log") as server, \
                SlotwiseProcess(server.url, work / f"slotwise-{phase}",
                                prefill={"mode": "chunk", "cold_tokens": 1000}) as proxy:
            asyncio.run(first_request(server.url))
            yield proxy

    log("baseline: a cold turn, then a cached one …")
    with fresh("baseline") as proxy:
        cold, cached = asyncio.run(baseline(proxy.url, sc))
    figures.cold_ttft_s, figures.cached_ttft_s = cold.ttft, cached.ttft
    alone = cold.ttft or 0.0
    for name, after in (("full", alone), ("half", alone / 2)):
        log(f"warmed, the turn after {after:.2f} s …")
        with fresh(f"warm-{name}") as proxy:
            result = asyncio.run(warmed_turn(proxy.url, sc, after))
        records = proxy.records()
        figures.warm_records += [r for r in records if r.get("kind") == "warm"]
        if name == "full":
            figures.warm_full_ttft_s = result.ttft
            _turn_facts(figures, records)
        else:
            figures.warm_half_ttft_s = result.ttft
    for name, warm in (("streams-warm", True), ("streams-chunk", False)):
        log(f"{name} …")
        with fresh(name) as proxy:
            run = asyncio.run(streams_with(proxy.url, sc, warm=warm))
        lo, hi = run.window
        if warm:
            figures.during_warm = window_figures(run.streams, lo, hi)
            figures.streams_alone_rate = decode_rate(run.streams, None, lo)
            figures.short_alone_ttft_s = run.short_alone.ttft if run.short_alone else None
            figures.short_during_warm_ttft_s = run.short_during.ttft if run.short_during else None
            figures.warm_records += [r for r in proxy.records() if r.get("kind") == "warm"]
        else:
            figures.during_chunk = window_figures(run.streams, lo, hi)
    return figures


def _turn_facts(figures: WarmFigures, records: list[dict[str, Any]]) -> None:
    """The warmed turn's own record: how much of its prompt it found cached, and was credited."""
    turns = [r for r in records if r.get("kind") == "chat"]
    if not turns:
        return
    record = turns[-1]
    timings, total = record.get("timings") or {}, record.get("prompt_tokens")
    figures.history_tokens = total
    if isinstance(total, int) and total and isinstance(timings.get("cache_n"), int):
        figures.warm_full_cached_share = timings["cache_n"] / total
    figures.warm_full_warmed_tokens = record.get("warmed_tokens")
