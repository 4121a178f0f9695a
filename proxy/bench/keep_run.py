"""What `slotwise bench keep` measures, on the testbed (docs/keep-kv.md, issue #15's aims).

1. A returning user: a long conversation's turn the day before (computed cold, then saved by
   keep_kv), llama-server restarted overnight, and the next morning's turn while others decode: its
   time to first token restored, against the same turn recomputed on a fresh server through slotwise
   without keep_kv, and the decoders' longest gap meanwhile.
2. Many conversations over few slots: each one's turn on day one (saved), llama-server restarted, and
   each one's next turn on day two, with a disk budget for all of them and one for fewer (the files of
   day one are copied, so both budgets start from the same saves): the share of each turn's prompt
   found cached.
Every phase runs llama-server with one shared KV (`-kvu`) and no RAM cache (`--cache-ram 0`), so what
is cached after a restart came from a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.bench.harness import StreamResult, timed_stream
from proxy.keep.index import INDEX_NAME
from proxy.testbed.server import LlamaServer, free_port
from proxy.testbed.slotwise import SlotwiseProcess
from proxy.testbed.words import filler

PREFILL = {"mode": "chunk"}
WAIT_S = 600.0


@dataclass(frozen=True)
class KeepScenario:
    history_words: int = 2900
    """The returning user's history (about 14k tokens on the testbed models)."""
    decoders: int = 3
    conversations: int = 20
    conv_words: int = 400
    slots: int = 4
    small_budget: int = 10
    """The conversations the smaller disk budget holds."""
    ctx: int = 32768
    lead_s: float = 2.0


@dataclass
class Turn:
    ttft_s: float | None
    prompt_tokens: int | None
    computed: int | None
    """Prompt tokens computed for the turn: by the request itself and by pieces fed ahead of it."""
    restored_tokens: int
    decoder_gap_s: float | None = None
    """The decoders' longest gap between the turn's arrival and its first token."""

    @property
    def cached_share(self) -> float | None:
        """The share of its prompt the turn found cached before it arrived."""
        if not self.prompt_tokens or self.computed is None:
            return None
        return 1.0 - self.computed / self.prompt_tokens


@dataclass
class KeepFigures:
    returning_restored: Turn | None = None
    returning_recomputed: Turn | None = None
    day_one_s: float | None = None
    budgets: dict[str, list[Turn]] = field(default_factory=dict)
    """Day two's turns in day one's order, by budget ("all", "N")."""

    def as_dict(self) -> dict[str, Any]:
        return orjson.loads(orjson.dumps(self, default=lambda o: o.__dict__))  # type: ignore[no-any-return]


class Server:
    """A testbed llama-server that keeps its port across restarts (slotwise keeps its URL)."""

    def __init__(self, model: Path, args: list[str], log: Path) -> None:
        self.server = LlamaServer(model, args=args, log_path=log, port=free_port(),
                                  startup_timeout=180.0)

    def restart(self) -> None:
        self.server.stop()
        self.server.start()

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        with self.server:
            yield self.server.url


def server_args(sc: KeepScenario, save_dir: Path) -> list[str]:
    return ["-np", str(sc.slots), "-kvu", "-c", str(sc.ctx), "--cache-ram", "0",
            "--slot-save-path", str(save_dir)]


def keep_table(save_dir: Path, **knobs: Any) -> dict[str, Any]:
    return {"enabled": True, "dir": str(save_dir), "save_after_idle_s": 1.0, "min_tokens": 256,
            "max_disk_gb": 1000.0, "max_files": 1000, **knobs}


def history(seed: int, words: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": f"You are helpful. Conversation {seed}."}]
    left, i = words, 0
    while left > 0:
        take = min(left, 120)
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": filler(rng, take)})
        left, i = left - take, i + 1
    if messages[-1]["role"] == "user":
        messages.append({"role": "assistant", "content": "Noted."})
    return messages


def turn(messages: list[dict[str, str]], text: str, tokens: int = 8) -> dict[str, Any]:
    return {"messages": [*messages, {"role": "user", "content": text}], "max_tokens": tokens,
            "stream": True}


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        return await response.json()


async def keep_status(session: aiohttp.ClientSession, sw: SlotwiseProcess) -> dict[str, Any]:
    body = await _get(session, sw.url + "/slotwise/status")
    section: dict[str, Any] = body["keep_kv"]
    return section


async def wait_until(session: aiohttp.ClientSession, sw: SlotwiseProcess, key: str, at_least: int,
                     what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        section = await keep_status(session, sw)
        if section.get("working") is False:
            raise RuntimeError(f"keep_kv does not work: {section.get('note')}")
        value = section.get("working") if key == "working" else section.get("saves", {}).get(key, 0)
        if value is True or (isinstance(value, int) and not isinstance(value, bool)
                             and value >= at_least):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def done_turns(sw: SlotwiseProcess) -> list[dict[str, Any]]:
    return [r for r in sw.records() if r.get("kind") == "chat" and r.get("outcome") == "done"]


async def turn_figures(sw: SlotwiseProcess, result: StreamResult, before: int) -> Turn:
    """The figures of the turn that ended as the `before + 1`-th done chat record (it is written
    just after the response's last byte)."""
    deadline = time.monotonic() + 10.0
    while len(done := done_turns(sw)) <= before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    last = done[-1] if len(done) > before else {}
    prompt_n = (last.get("timings") or {}).get("prompt_n")
    computed = prompt_n + int(last.get("fed_tokens") or 0) if isinstance(prompt_n, int) else None
    return Turn(ttft_s=result.ttft, prompt_tokens=last.get("prompt_tokens"), computed=computed,
                restored_tokens=int(last.get("restored_tokens") or 0))


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=WAIT_S),
                                 connector=aiohttp.TCPConnector(force_close=True))


async def decode(s: aiohttp.ClientSession, url: str, i: int, result: StreamResult) -> None:
    """A stream that generates until cancelled, noting each token event's time in `result`."""
    body = {"messages": [{"role": "user", "content": f"Story {i}, please."}], "stream": True,
            "max_tokens": 100_000, "ignore_eos": True}
    async with s.post(url + "/v1/chat/completions", json=body) as response:
        async for chunk in response.content.iter_any():
            result.tokens += [time.monotonic()] * chunk.count(b'"content":"')


async def with_decoders(sw: SlotwiseProcess, body: dict[str, Any], decoders: int,
                        lead_s: float) -> Turn:
    """`body` sent while `decoders` streams generate; the turn's figures and their longest gap."""
    before = len(done_turns(sw))
    results = [StreamResult(sent=time.monotonic()) for _ in range(decoders)]
    async with session() as s:
        streams = [asyncio.create_task(decode(s, sw.url, i, r)) for i, r in enumerate(results)]
        try:
            await asyncio.sleep(lead_s)
            result = await timed_stream(s, sw.url, body)
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    figures = await turn_figures(sw, result, before)
    figures.decoder_gap_s = longest_gap(results, result)
    return figures


def longest_gap(decoders: list[StreamResult], turn_result: StreamResult) -> float | None:
    """The decoders' longest gap between token events while the turn waited for its first token."""
    end = turn_result.tokens[0] if turn_result.tokens else turn_result.ended or turn_result.sent
    gaps = []
    for result in decoders:
        tokens = [t for t in result.tokens if turn_result.sent <= t <= end]
        gaps += [b - a for a, b in itertools.pairwise(tokens)]
    return max(gaps, default=None)


async def returning_user(model: Path, sc: KeepScenario, work: Path, figures: KeepFigures) -> None:
    save = work / "returning-kv"
    save.mkdir(parents=True)
    server = Server(model, server_args(sc, save), work / "returning-llama.log")
    talk = history(1, sc.history_words)
    morning = [*talk, {"role": "user", "content": "Good night."}, {"role": "assistant", "content": "Bye."}]
    with server.running() as url:
        with SlotwiseProcess(url, work / "returning-keep", prefill=PREFILL,
                             keep_kv=keep_table(save)) as sw:
            async with session() as s:
                await wait_until(s, sw, "working", 1, "the keep_kv probe")
                day_one = await timed_stream(s, sw.url, turn(talk, "Good night."))
                figures.day_one_s = day_one.ttft
                await wait_until(s, sw, "done", 1, "the conversation's save")
            server.restart()
            figures.returning_restored = await with_decoders(
                sw, turn(morning, "Good morning!"), sc.decoders, sc.lead_s)
        server.restart()
        with SlotwiseProcess(url, work / "returning-cold", prefill=PREFILL) as cold:
            figures.returning_recomputed = await with_decoders(
                cold, turn(morning, "Good morning!"), sc.decoders, sc.lead_s)


async def many_conversations(model: Path, sc: KeepScenario, work: Path, figures: KeepFigures) -> None:
    day_one = work / "day-one-kv"
    day_one.mkdir(parents=True)
    talks = [history(100 + i, sc.conv_words) for i in range(sc.conversations)]
    server = Server(model, server_args(sc, day_one), work / "day-one-llama.log")
    with server.running() as url, SlotwiseProcess(url, work / "day-one", prefill=PREFILL,
                                                  keep_kv=keep_table(day_one)) as sw:
        async with session() as s:
            await wait_until(s, sw, "working", 1, "the keep_kv probe")
            for i, talk in enumerate(talks):
                await timed_stream(s, sw.url, turn(talk, "See you tomorrow."))
                await wait_until(s, sw, "done", i + 1, f"conversation {i + 1}'s save")
    sizes = [f["size"] for f in orjson.loads((day_one / INDEX_NAME).read_bytes())["files"]]
    for label, keep in (("all", len(sizes)), (str(sc.small_budget), sc.small_budget)):
        budget_gb = (sum(sorted(sizes)[-keep:]) + min(sizes) // 2) / 1e9
        figures.budgets[label] = await day_two(model, sc, work / f"day-two-{label}", day_one, talks,
                                               budget_gb)


async def day_two(model: Path, sc: KeepScenario, work: Path, day_one: Path,
                  talks: list[list[dict[str, str]]], budget_gb: float) -> list[Turn]:
    save = work / "kv"
    shutil.copytree(day_one, save)
    server = Server(model, server_args(sc, save), work / "llama.log")
    turns = []
    knobs = keep_table(save, max_disk_gb=budget_gb, save_after_idle_s=86400.0)
    with server.running() as url, SlotwiseProcess(url, work / "slotwise", prefill=PREFILL,
                                                  keep_kv=knobs) as sw:
        async with session() as s:
            await wait_until(s, sw, "working", 1, "the keep_kv probe")
            for talk in talks:
                body = turn([*talk, {"role": "user", "content": "See you tomorrow."},
                             {"role": "assistant", "content": "Bye."}], "Hello again!")
                before = len(done_turns(sw))
                turns.append(await turn_figures(sw, await timed_stream(s, sw.url, body), before))
    return turns


async def measure(model: Path, sc: KeepScenario, work: Path) -> KeepFigures:
    """Both parts; the KV files (GBs at full size) are deleted at the end, the logs stay in `work`."""
    figures = KeepFigures()
    try:
        await returning_user(model, sc, work, figures)
        await many_conversations(model, sc, work, figures)
    finally:
        for kv in [p for p in work.rglob("*kv") if p.is_dir()]:
            shutil.rmtree(kv, ignore_errors=True)
    return figures
