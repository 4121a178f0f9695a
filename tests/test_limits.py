"""Bounded resources, against a fake upstream (a real server cannot drip, stall or send a huge event on
demand): time limits on a request's head, its body and an idle kept-alive connection; a limit on open
connections answered 503; 1,000 idle connections; a size limit per upstream stream event; finished
requests not kept in memory by a long one; the shutdown grace counted once."""

from __future__ import annotations

import asyncio
import gc
import re
import resource
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from proxy.bench.soak_clients import closed_within
from proxy.config import ListenConfig
from proxy.listener import CUT_WAIT_S, FILES_BESIDES_CONNECTIONS, ensure_open_files
from proxy.ops.lifecycle import Operations, reload_config
from proxy.record.flight import Flight
from proxy.record.schema import MAX_OVERLAPS
from proxy.runner import ProxyThread
from tests.conftest import StartProxy
from tests.helpers import read_records, serve_app
from tests.served import Served, serve, write_config


def chat_body(model: str = "fast", tokens: int = 5) -> dict[str, Any]:
    return {"model": model, "max_tokens": tokens, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}


async def connect(proxy: ProxyThread) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def seconds_until_closed(proxy: ProxyThread, *, drip: bool, limit: float = 10.0) -> float:
    reader, writer = await connect(proxy)
    t0 = time.monotonic()
    try:
        assert await closed_within(reader, writer, limit, drip=drip), "slotwise left it open"
    finally:
        writer.close()
    return time.monotonic() - t0


async def chat(session: aiohttp.ClientSession, proxy: ProxyThread, model: str = "fast",
               tokens: int = 5) -> bytes:
    async with session.post(proxy.url + "/v1/chat/completions",
                            json=chat_body(model, tokens)) as response:
        assert response.status == 200
        return await response.read()


def head(path: str, length: int, *, keep_alive: bool = False) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: slotwise\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n").encode()


async def answer_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and headers of the next HTTP answer on a raw connection."""
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = raw.decode().split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines if line)
    return int(status_line.split()[1]), {k.lower(): v for k, v in fields.items()}


# --- the head, the body, the idle connection ---------------------------------------------------

async def test_a_connection_that_sends_nothing_is_closed_at_the_header_time_limit(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, listen={"header_timeout_s": 1})
    assert 0.8 < await seconds_until_closed(proxy, drip=False) < 3.0
    proxy.stop()
    assert read_records(proxy) == []  # no request was read: nothing to record


async def test_a_request_head_sent_a_line_at_a_time_is_cut_at_the_header_time_limit(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, listen={"header_timeout_s": 1})
    assert 0.8 < await seconds_until_closed(proxy, drip=True) < 3.0


async def test_an_idle_kept_alive_connection_is_closed_after_keepalive_timeout(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, listen={"header_timeout_s": 5, "keepalive_timeout_s": 1})
    reader, writer = await connect(proxy)
    for pause in (0.0, 0.5):  # a request soon after the last one is served on the same connection
        await asyncio.sleep(pause)
        writer.write(head("/tokenize", 2, keep_alive=True) + b"{}")
        status, fields = await answer_head(reader)
        assert status == 200
        await reader.readexactly(int(fields["content-length"]))
    t0 = time.monotonic()
    assert await reader.read() == b""  # then idle: closed after 1 s, not the 5 s of the head
    assert 0.8 < time.monotonic() - t0 < 3.0
    writer.close()


async def test_a_body_that_does_not_arrive_in_time_gets_408_and_a_record(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, listen={"body_timeout_s": 1})
    reader, writer = await connect(proxy)
    writer.write(head("/v1/chat/completions", 200) + b'{"model": "fast", ')
    t0 = time.monotonic()
    status, fields = await answer_head(reader)
    assert status == 408 and 0.8 < time.monotonic() - t0 < 3.0
    assert fields["x-slotwise-error"] == "invalid_request_error"
    error = orjson.loads(await reader.readexactly(int(fields["content-length"])))["error"]
    assert "did not arrive within 1 s (listen.body_timeout_s)" in error["message"]
    writer.close()
    proxy.stop()
    (rec,) = read_records(proxy)
    assert (rec["status"], rec["outcome"]) == (408, "bad_request")


async def test_a_forwarded_body_that_stalls_gets_408_and_the_upstream_request_is_closed(
        start_proxy: StartProxy) -> None:
    reading: list[int] = []  # upstream requests still reading their body

    async def tokenize(request: web.Request) -> web.Response:
        reading.append(1)
        try:
            await request.read()
        finally:
            reading.pop()
        return web.json_response({"tokens": []})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    async with serve_app(app) as url:
        proxy = start_proxy(url, listen={"body_timeout_s": 1})
        reader, writer = await connect(proxy)
        writer.write(head("/tokenize", 1000) + b'{"content": "')  # streamed on as it comes
        status, _ = await answer_head(reader)
        writer.close()
        assert status == 408
        for _ in range(50):
            if not reading:
                break
            await asyncio.sleep(0.05)
        assert not reading, "the upstream request was left open"
    proxy.stop()
    (rec,) = read_records(proxy)
    assert (rec["status"], rec["endpoint"]) == (408, "/tokenize")


# --- the number of connections ----------------------------------------------------------------

async def test_a_connection_over_the_limit_gets_503_until_idle_ones_are_closed(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, listen={"max_connections": 5, "header_timeout_s": 1.5})
    idle = [await connect(proxy) for _ in range(5)]
    await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as session:
        async with session.post(proxy.url + "/v1/chat/completions", json=chat_body()) as response:
            assert response.status == 503
            assert response.headers["X-Slotwise-Error"] == "slotwise_overloaded"
            error = (await response.json())["error"]
        assert "too many open connections (listen.max_connections = 5)" in error["message"]
        for reader, writer in idle:  # the header time limit closes the idle ones ...
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        body = await chat(session, proxy)  # ... and a real request gets through again
    assert body.endswith(b"data: [DONE]\n\n")
    proxy.stop()
    assert [r["outcome"] for r in read_records(proxy)] == ["done"]


async def test_a_reload_applies_new_limits_to_new_connections(
        fake_url: str, start_proxy: StartProxy, tmp_path: Path) -> None:
    proxy = start_proxy(fake_url)
    changed = write_config(tmp_path / "c.toml", fake_url, Path(proxy.config.log.timing),
                           listen={"shutdown_grace_s": 3, "max_connections": 1})
    result = await asyncio.to_thread(proxy.call, reload_config(proxy.state, Operations(), changed))
    assert result.ok, result.message
    _, writer = await connect(proxy)  # the one connection now allowed
    await asyncio.sleep(0.1)
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/health") as response:
        assert response.status == 503
    writer.close()


IDLE = 1000


def open_files_for(connections: int) -> None:
    """Raise the soft limit on open files to the hard one; skip if even that is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * connections + 400  # the test's ends, the proxy's ends, upstream, files
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"{IDLE} idle connections need about {need} open files in this process; "
                    f"the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@pytest.mark.slow
async def test_1000_idle_connections_leave_real_requests_answered_and_are_closed_in_time(
        fake_url: str, start_proxy: StartProxy) -> None:
    open_files_for(IDLE)
    proxy = start_proxy(fake_url, listen={"header_timeout_s": 4})  # max_connections: the default
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for _ in range(IDLE // 100):
        idle += await asyncio.gather(*(connect(proxy) for _ in range(100)))
    opened = time.monotonic()
    async with aiohttp.ClientSession() as session:
        bodies = await asyncio.gather(*(chat(session, proxy, tokens=20) for _ in range(10)))
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    answered = time.monotonic() - opened
    assert answered < 3.0  # before the idle ones were closed

    async def closed(reader: asyncio.StreamReader) -> bool:
        return await asyncio.wait_for(reader.read(), 10) == b""

    results = await asyncio.gather(*(closed(reader) for reader, _ in idle))
    assert sum(results) == IDLE and time.monotonic() - opened < 9
    for _, writer in idle:
        writer.close()
    proxy.stop()
    assert len(read_records(proxy)) == 10


# --- one upstream event ----------------------------------------------------------------------

async def test_an_upstream_event_over_the_size_limit_ends_the_stream_with_an_error(
        start_proxy: StartProxy) -> None:
    async def huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\n')
        await response.write(b'data: {"choices": [{"delta": {"content": "')
        piece = b"x" * 65536
        for _ in range(512):  # 32 MiB without an end
            await response.write(piece)
        await response.write(b'"}}]}\n\n')
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", huge)
    async with serve_app(app) as url:
        proxy = start_proxy(url, upstream={"max_event_mb": 1})
        async with aiohttp.ClientSession() as session:
            body = await chat(session, proxy)
    first, last = body.strip().split(b"\n\n")
    assert b'"content": "ok"' in first and len(body) < 4096
    error = orjson.loads(last.removeprefix(b"data: "))["error"]
    assert "larger than 1 MiB (upstream.max_event_mb)" in error["message"]
    assert error["type"] == "slotwise_bad_upstream_stream"
    proxy.stop()
    (rec,) = read_records(proxy)
    assert rec["outcome"] == "upstream_error" and "upstream.max_event_mb" in rec["error"]


# --- memory ------------------------------------------------------------------------------------

def live_flights() -> int:
    gc.collect()
    return sum(isinstance(obj, Flight) for obj in gc.get_objects())


async def test_finished_requests_are_not_kept_in_memory_by_a_long_stream(
        fake_url: str, start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url)
    before = live_flights()
    started = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=20)) as session:

        async def long_stream() -> None:
            async with session.post(proxy.url + "/v1/chat/completions",
                                    json=chat_body("slow", 400)) as response:
                async for _ in response.content.iter_any():
                    started.set()

        running = asyncio.create_task(long_stream())
        await started.wait()
        await asyncio.gather(*(chat(session, proxy) for _ in range(1200)))
        live = live_flights() - before
        running.cancel()
    assert live <= 2  # the long stream's own (and at most one finishing), not 1,201
    proxy.stop()
    records = read_records(proxy, 1201)
    (long,) = [r for r in records if r["events"] > 5]
    assert long["overlaps_total"] == 1200  # its record still sees every prefill beside it
    assert len(long["overlaps"]) == MAX_OVERLAPS  # and lists the biggest


# --- the shutdown grace ---------------------------------------------------------------------------

async def test_sigterm_cuts_a_stream_at_the_grace_period_not_twice_it(
        fake_url: str, tmp_path: Path, serving: list[Served]) -> None:
    timing = tmp_path / "timing.jsonl"
    config = write_config(tmp_path / "c.toml", fake_url, timing, listen={"shutdown_grace_s": 2})
    served = await asyncio.to_thread(serve, config)
    serving.append(served)
    started = asyncio.Event()

    async def stream() -> bytes:
        chunks = []
        async with aiohttp.ClientSession() as session, session.post(
                served.url + "/v1/chat/completions", json=chat_body("slow", 400)) as response:
            async for chunk in response.content.iter_any():
                chunks.append(chunk)
                started.set()
        return b"".join(chunks)

    running = asyncio.create_task(stream())
    await started.wait()
    t0 = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 20) == 0
    stopped = time.monotonic() - t0
    assert 1.9 < stopped < 3.2  # the 2 s grace once (it was twice: ~4 s)
    body = await running  # ended by slotwise's error event, the body whole
    assert body.endswith(b"\n\n") and b'"type":"slotwise_shutting_down"' in body.rsplit(b"data: ", 1)[1]
    (rec,) = read_records(timing)
    assert rec["outcome"] == "shutdown" and 1900 < rec["total_ms"] < 3200


# --- the open files the limits need ----------------------------------------------------------------

def test_the_soft_open_files_limit_is_raised_for_max_connections_or_a_warning_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"now": (128, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _, value: limits.update(now=value))
    assert ensure_open_files(1024) is None and limits["now"] == (2 * 1024 + 64, 4096)
    limits["now"] = (128, 256)
    warning = ensure_open_files(1024)
    assert limits["now"] == (256, 256)
    assert warning is not None and "listen.max_connections = 1024 needs about 2112 open files" in warning


def test_the_systemd_unit_leaves_room_for_the_default_grace_and_connections() -> None:
    unit = (Path(__file__).parent.parent / "systemd" / "slotwise.service").read_text()
    values = {key: int(value) for key, value in
              re.findall(r"^(TimeoutStopSec|LimitNOFILE)=(\d+)$", unit, re.MULTILINE)}
    listen = ListenConfig()
    assert values["TimeoutStopSec"] >= listen.shutdown_grace_s + CUT_WAIT_S + 5
    assert values["LimitNOFILE"] >= 2 * listen.max_connections + FILES_BESIDES_CONNECTIONS
