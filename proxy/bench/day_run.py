"""Plays the day on a real llama-server: the I/O of `slotwise bench day`. Each path gets a fresh
llama-server with the testbed model and its LoRA adapter; slotwise's path first has its evening
before (the returning users' last turns computed through slotwise with keep_kv and saved, a chat
with short follow-ups, then llama-server restarted). The day's users are coroutines following
their scripts (proxy/bench/day.py); what the client saw and the path's timing records become the
figures (day_records.py, day_tables.py).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from proxy.bench import day_talk as talk
from proxy.bench.calls import Call, client_log, timed_call
from proxy.bench.day import (
    PURPOSE,
    THROUGH_SLOTWISE,
    Act,
    DayPlan,
    Step,
    User,
    chunk_tables,
    server_args,
    slots_of,
    slotwise_tables,
)
from proxy.bench.day_records import (
    Alone,
    alone_body,
    cold_calls,
    day_figures,
)
from proxy.bench.day_tables import report_tables
from proxy.bench.harness import timed_stream
from proxy.bench.keep_run import session, wait_until
from proxy.bench.warm import first_request, post_warm
from proxy.report.records import InputError, LoadedTimingLog, load_timing_log
from proxy.testbed.model import ModelFiles
from proxy.testbed.server import LlamaServer
from proxy.testbed.slotwise import SlotwiseProcess

STARTUP_S = 180.0


class DayClient:
    """The chat app of every user on one path: sends their requests, warms a conversation where
    slotwise serves warm-ups, and keeps every call."""

    def __init__(self, http: aiohttp.ClientSession, url: str, plan: DayPlan, *, warm: bool) -> None:
        self.http, self.url, self.plan, self.can_warm = http, url, plan, warm
        self.calls: list[Call] = []
        self.warm_refused = 0

    async def send(self, user: User, step: Step, messages: talk.Messages, request_id: str) -> Call:
        return await timed_call(self.http, self.url, talk.body(messages, step, user),
                                talk.headers(user, step.act, request_id), self.calls,
                                request_id=request_id, who=user.name, act=step.act,
                                purpose=PURPOSE[step.act])

    async def warm(self, user: User, messages: talk.Messages, request_id: str) -> None:
        """The app's warm-up call (docs/warm.md); a path without slotwise has no such endpoint."""
        if not self.can_warm:
            return
        try:
            await post_warm(self.http, self.url, messages,
                            headers=talk.headers(user, Act.WARM, request_id))
        except (aiohttp.ClientError, RuntimeError, TimeoutError):
            self.warm_refused += 1


async def play_user(client: DayClient, user: User, t0: float) -> None:
    """One user's script: each step after its think time (and not before its time of day)."""
    seed, conversation = client.plan.seed, talk.opening(user, client.plan.seed)
    last_end = t0
    for index, step in enumerate(user.steps):
        start = max(last_end + step.think_s, t0 + step.not_before_s)
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        request_id = f"{user.name}-{index}"
        if step.act is Act.WARM:
            await client.warm(user, conversation, request_id)
            last_end = time.monotonic()
            continue
        if step.act is Act.TRANSLATE:
            messages = talk.translation(client.plan, index)
        elif step.act is Act.SUMMARY:
            messages = talk.summary_request(conversation)
        else:
            messages = [*conversation, talk.message(user, seed, index)]
        call = await client.send(user, step, messages, request_id)
        if step.act is Act.SUMMARY:
            conversation = talk.folded(user, seed, conversation, call.result.text)
        elif step.act is not Act.TRANSLATE:
            conversation = [*messages, {"role": "assistant", "content": call.result.text}]
        last_end = call.end


async def play_day(url: str, plan: DayPlan, *, warm: bool) -> tuple[list[Call], float, int]:
    """Every user at once, until each script ends or `plan.limit_s` cuts the day; the calls, the
    offset from the monotonic clock to Unix time, and how many warm-ups were refused."""
    async with session() as http:
        client = DayClient(http, url, plan, warm=warm)
        t0 = time.monotonic()
        offset = time.time() - t0
        users = [asyncio.create_task(play_user(client, user, t0)) for user in plan.users]
        done, cut = await asyncio.wait(users, timeout=plan.limit_s)
        for task in cut:
            task.cancel()
        await asyncio.gather(*cut, return_exceptions=True)
        for task in done:
            task.result()  # a bug in a user's script stops the benchmark
    return client.calls, offset, client.warm_refused


async def evening(sw: SlotwiseProcess, plan: DayPlan) -> None:
    """Yesterday: each returning user's last turn through slotwise, and its save to a file; then
    a chat with short follow-ups (`evening_chat`)."""
    async with session() as http:
        await wait_until(http, sw, "working", 1, "the keep_kv probe")
        returning = [u for u in plan.users if u.yesterday_tokens]
        for n, user in enumerate(returning, start=1):
            result = await timed_stream(http, sw.url, talk.yesterday_body(user, plan.seed),
                                        headers=talk.headers(user, Act.CHAT, f"{user.name}-yesterday"))
            if not result.tokens:
                raise RuntimeError(f"{user.name}'s turn of yesterday failed ({result.status})")
            await wait_until(http, sw, "done", n, f"{user.name}'s conversation saved")
        await evening_chat(http, sw.url, plan)


async def evening_chat(http: aiohttp.ClientSession, url: str, plan: DayPlan) -> None:
    """Yesterday's chat: a first turn, then follow-ups that send each reply back as it came.
    What slotwise learns of them (the row-by-row price of a short turn, whether a follow-up finds
    its reply whole) is kept in its learned file for the day, as a server that ran all of
    yesterday would have it: with no short follow-up before the day, its returning users' first
    turns went row by row (`dan-0`'s 58 tokens after his restore froze every stream 1.8 s)."""
    user = plan.users[0]
    messages = talk.evening_card(plan, user)
    for i in range(talk.EVENING_FOLLOW_UPS + 1):
        messages.append(talk.message(user, plan.seed, i))
        result = await timed_stream(http, url, talk.body(messages, talk.evening_step(), user),
                                    headers=talk.headers(user, Act.CHAT, f"{user.name}-yesterday-{i}"),
                                    detail=True)
        if not result.tokens:
            raise RuntimeError(f"{user.name}'s chat of yesterday failed ({result.status})")
        messages.append({"role": "assistant", "content": result.text})


async def time_alone(url: str, calls: Sequence[Call]) -> dict[str, Alone]:
    """After the day, on the same server with nothing else running: each call's prompt computed
    again whole, one at a time; what the server's timings said of each (a call it refused, or
    answered without timings, is left out)."""
    out: dict[str, Alone] = {}
    async with session() as http:
        for call in calls:
            async with http.post(url + "/v1/chat/completions", json=alone_body(call)) as response:
                if response.status != 200:
                    continue
                timings = (await response.json()).get("timings") or {}
            n, ms = timings.get("prompt_n"), timings.get("prompt_ms")
            if isinstance(n, int) and n > 0 and isinstance(ms, int | float):
                out[call.id] = Alone(n, float(ms))
    return out


def run_path(model: ModelFiles, plan: DayPlan, setup: Sequence[str], path: str, work: Path,
             say: Callable[[str], None] = print) -> dict[str, Any]:
    """One path of one set-up, on fresh servers; its report tables and the day's figures."""
    args = server_args(setup, path, plan.ctx_per_slot)
    save = work / "kv"
    if path == "slotwise":
        save.mkdir(parents=True, exist_ok=True)
        args += ["--slot-save-path", str(save)]
    began = time.monotonic()
    try:
        if path == "slotwise":
            say(f"  yesterday: {', '.join(u.name for u in plan.users if u.yesterday_tokens)}'s "
                "conversations computed through slotwise and saved …")
            _evening(model, plan, args, work, save)
        say(f"  the day: llama-server {' '.join(args)} (then its cold prompts, each alone) …")
        calls, log, proxy, refused, alone = _day(model, plan, args, path, work, save)
    finally:
        shutil.rmtree(save, ignore_errors=True)  # GBs at full scale
    figures = day_figures(calls, proxy, slots_of(args), alone)
    figures["not_played"] = plan.requests() - len(calls)
    figures["warmups_refused"] = refused
    figures["elapsed_s"] = time.monotonic() - began
    return {"server_args": args, "tables": report_tables(log.records, log, plan.thresholds()),
            "day": figures}


LEARNED = "slotwise-learned.json"
"""What slotwise learned of the server yesterday, kept for the day (the run's folder)."""


def _server(model: ModelFiles, args: list[str], log: Path) -> LlamaServer:
    return LlamaServer(model.model, lora=model.lora, args=args, log_path=log,
                       startup_timeout=STARTUP_S)


def _evening(model: ModelFiles, plan: DayPlan, args: list[str], work: Path, save: Path) -> None:
    with _server(model, args, work / "llama-server-yesterday.log") as server, \
            SlotwiseProcess(server.url, work / "slotwise-yesterday",
                            **slotwise_tables(plan, str(save), str(work / LEARNED),
                                              yesterday=True)) as sw:
        asyncio.run(evening(sw, plan))


def _day(model: ModelFiles, plan: DayPlan, args: list[str], path: str, work: Path, save: Path
         ) -> tuple[list[Call], LoadedTimingLog, list[dict[str, Any]], int, dict[str, Alone]]:
    """The day on a fresh llama-server, direct or through slotwise; the calls, the timing records
    the tables come from (slotwise's own, or the client's for a direct path), slotwise's records,
    the warm-ups refused, and the cold requests' prompts timed alone after the day."""
    with _server(model, args, work / "llama-server.log") as server:
        asyncio.run(first_request(server.url))  # a fresh server's first request sets it up
        if path not in THROUGH_SLOTWISE:
            calls, offset, refused = asyncio.run(play_day(server.url, plan, warm=False))
            log, proxy = _client_log(work, calls, offset), []
        else:
            everything = path == "slotwise"
            tables = (slotwise_tables(plan, str(save), str(work / LEARNED)) if everything
                      else chunk_tables(plan))
            with SlotwiseProcess(server.url, work / "slotwise", **tables) as sw:
                if everything:
                    asyncio.run(_wait_keep(sw))
                calls, offset, refused = asyncio.run(play_day(sw.url, plan, warm=everything))
            _client_log(work, calls, offset)  # kept beside slotwise's, to compare
            log, proxy = _load(sw.timing_path), sw.records()
        cold = cold_calls(calls, proxy, plan.long_tokens)
        alone = asyncio.run(time_alone(server.url, cold))  # slotwise stopped: nothing else runs
        return calls, log, proxy, refused, alone


async def _wait_keep(sw: SlotwiseProcess) -> None:
    async with session() as http:
        await wait_until(http, sw, "working", 1, "the keep_kv probe")


def _client_log(work: Path, calls: list[Call], offset: float) -> LoadedTimingLog:
    """The calls as timing records in `work/client.jsonl` (`slotwise report` reads it too)."""
    path = work / "client.jsonl"
    path.write_bytes(client_log(calls, offset))
    return _load(path)


def _load(path: Path) -> LoadedTimingLog:
    try:
        return load_timing_log(str(path))
    except InputError:  # no request reached the log: the tables say so with empty rows
        return LoadedTimingLog(str(path), (), 0, ())
