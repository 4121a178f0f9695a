"""Operating slotwise against the fake upstream: config reload (valid, invalid, restart-only keys)
and SIGTERM on a real `slotwise serve` process. The real-server versions are in test_ops_real.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.ops.lifecycle import Operations, reload_config
from proxy.record.flight import PrefillPlan
from proxy.request.admission import ADMISSION
from proxy.runner import ProxyThread
from tests.conftest import StartProxy
from tests.helpers import http, read_records
from tests.served import GRACE_S, SLOTWISE, Served, serve, write_config


async def stream_chat(url: str, tokens: int, started: asyncio.Event | None = None,
                      model: str = "slow") -> bytes:
    body = {"model": model, "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    chunks = []
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/chat/completions", json=body) as response:
        async for chunk in response.content.iter_any():
            chunks.append(chunk)
            if started is not None:
                started.set()
    return b"".join(chunks)


# --- reload, in process ---------------------------------------------------------------------

@pytest.fixture
def upstream_url(fake_url: str) -> str:
    return fake_url


@pytest.fixture
def proxy_tables() -> dict[str, Any]:
    return {"prefill": {"max_hold_s": 30}, "listen": {"shutdown_grace_s": GRACE_S}}


async def reload_from(proxy: ProxyThread, path: Path) -> Any:
    return await asyncio.to_thread(proxy.call, reload_config(proxy.state, Operations(), path))


async def test_a_valid_reload_applies_to_new_requests_and_leaves_the_stream_running(
        proxy: ProxyThread, fake_url: str, tmp_path: Path) -> None:
    started = asyncio.Event()
    running = asyncio.create_task(stream_chat(proxy.url, 30, started))
    await started.wait()
    new_file = write_config(tmp_path / "new.toml", fake_url, Path(proxy.config.log.timing),
                            prefill={"max_hold_s": 5})
    result = await reload_from(proxy, new_file)
    assert result.ok and result.config_gen == 2
    assert proxy.state.config.prefill.max_hold_s == 5
    await stream_chat(proxy.url, 3)
    body = await running
    assert body.count(b'"content":"tok"') == 30 and body.endswith(b"data: [DONE]\n\n")
    await asyncio.to_thread(proxy.stop)  # every record written
    first, second = sorted(read_records(proxy), key=lambda r: r["start"])
    assert (first["config_gen"], first["outcome"], first["events"]) == (1, "done", 30)
    assert (second["config_gen"], second["outcome"]) == (2, "done")


async def test_an_invalid_reload_is_refused_with_the_start_error_and_changes_nothing(
        proxy: ProxyThread, fake_url: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    bad = write_config(tmp_path / "bad.toml", fake_url, Path(proxy.config.log.timing),
                       prefill={"mode": "chunks"})
    before = proxy.state.config
    with caplog.at_level("ERROR", logger="slotwise"):
        result = await reload_from(proxy, bad)
    expected = "prefill.mode: unknown mode 'chunks' (valid: off, defer, chunk)"
    assert not result.ok and expected in result.message
    assert proxy.state.config is before and proxy.state.config_gen == 1
    assert any("reload refused" in r.message and expected in r.message for r in caplog.records)
    broken = tmp_path / "broken.toml"
    broken.write_text("[prefill\n")
    assert "not valid TOML" in (await reload_from(proxy, broken)).message
    await stream_chat(proxy.url, 2)
    await asyncio.to_thread(proxy.stop)
    assert [r["config_gen"] for r in read_records(proxy)] == [1]


async def test_a_reload_that_changes_a_restart_only_key_is_refused(
        proxy: ProxyThread, fake_url: str, tmp_path: Path) -> None:
    moved = write_config(tmp_path / "moved.toml", fake_url, Path(proxy.config.log.timing),
                         prefill={"max_hold_s": 30}, listen={"host": "127.0.0.2"})
    result = await reload_from(proxy, moved)
    assert not result.ok and "listen.host:" in result.message
    assert "takes effect only on a restart" in result.message and proxy.state.config_gen == 1


# --- a real `slotwise serve` process ----------------------------------------------------------

async def test_sigterm_lets_the_stream_finish_refuses_new_connections_and_exits_0(
        fake_url: str, tmp_path: Path, serving: list[Served]) -> None:
    timing = tmp_path / "timing.jsonl"
    served = await asyncio.to_thread(serve, write_config(tmp_path / "c.toml", fake_url, timing))
    serving.append(served)
    started = asyncio.Event()
    running = asyncio.create_task(stream_chat(served.url, 40, started))
    await started.wait()
    served.process.send_signal(signal.SIGTERM)
    await asyncio.to_thread(served.wait_for, "slotwise stopping: 1 requests in flight")
    served.process.send_signal(signal.SIGTERM)  # impatience does not cut the stream
    await asyncio.to_thread(served.wait_for, "already stopping: 1 requests still in flight")
    with pytest.raises(aiohttp.ClientConnectionError):
        await stream_chat(served.url, 1)
    body = await running
    assert body.count(b'"content":"tok"') == 40 and body.endswith(b"data: [DONE]\n\n")
    assert await asyncio.to_thread(served.process.wait, 20) == 0
    (rec,) = read_records(timing)
    assert rec["outcome"] == "done" and rec["events"] == 40
    assert "1 timing records written" in "".join(served.lines)


async def unanswered_chat(url: str) -> tuple[int, dict[str, Any]]:
    """A request the upstream never answers (as one held by the prefill policy, it has no answer
    yet when the grace period ends)."""
    body = {"model": "silent", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/chat/completions", json=body) as response:
        return response.status, await response.json()


async def test_sigterm_cuts_what_outlives_the_grace_period_cleanly_and_records_it(
        fake_url: str, tmp_path: Path, serving: list[Served]) -> None:
    """At the end of the grace a stream gets an error event and a clean end of its body (it was
    cut mid-chunk), and a request without an answer yet slotwise's 503 (it was a bare disconnect)."""
    timing = tmp_path / "timing.jsonl"
    config = write_config(tmp_path / "c.toml", fake_url, timing, listen={"shutdown_grace_s": 0.5})
    served = await asyncio.to_thread(serve, config)
    serving.append(served)
    started = asyncio.Event()
    running = asyncio.create_task(stream_chat(served.url, 400, started))
    waiting = asyncio.create_task(unanswered_chat(served.url))
    await started.wait()
    await asyncio.sleep(0.2)  # the unanswered request is in
    t0 = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 20) == 0
    assert time.monotonic() - t0 < 5
    body = await running  # no ClientPayloadError: the chunked body ended as it should
    last = orjson.loads(body.strip().split(b"\n\n")[-1].removeprefix(b"data: "))["error"]
    assert last["type"] == "slotwise_shutting_down" and "stopping" in last["message"]
    status, answer = await waiting
    assert status == 503 and answer["error"]["type"] == "slotwise_shutting_down"
    records = sorted(read_records(timing), key=lambda r: r["status"])
    assert [(r["status"], r["outcome"]) for r in records] == [(200, "shutdown"), (503, "shutdown")]
    assert 0 < records[0]["events"] < 400 and "stopping" in records[0]["error"]


def reload_cli(config: Path, url: str) -> subprocess.CompletedProcess[str]:
    """`slotwise reload`; the config listens on port 0, so it is told the URL."""
    return subprocess.run([str(SLOTWISE), "reload", "--config", str(config), "--url", url],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NO_COLOR": "1"})


@pytest.mark.parametrize("access", [
    {"clients": [{"name": "ann", "key": "ann-key"}], "pages_token": "page-token"},
    {"admin_key": "admin-key"}], ids=["client-keys-and-pages-token", "admin-key"])
async def test_reload_asks_the_status_page_with_the_configured_token(
        fake_url: str, tmp_path: Path, serving: list[Served], access: dict[str, Any]) -> None:
    config = write_config(tmp_path / "c.toml", fake_url, tmp_path / "timing.jsonl", access=access)
    served = await asyncio.to_thread(serve, config)
    serving.append(served)
    cli = await asyncio.to_thread(reload_cli, config, served.url)
    assert cli.returncode == 0, cli.stderr
    assert "generation 2 in force" in cli.stdout
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 20) == 0


async def test_reload_says_what_to_do_when_the_status_page_is_off(
        fake_url: str, tmp_path: Path, serving: list[Served]) -> None:
    config = write_config(tmp_path / "c.toml", fake_url, tmp_path / "timing.jsonl",
                          access={"clients": [{"name": "ann", "key": "ann-key"}]})
    served = await asyncio.to_thread(serve, config)
    serving.append(served)
    cli = await asyncio.to_thread(reload_cli, config, served.url)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    assert "the status page is off" in cli.stderr and "access.pages_token" in cli.stderr
    assert "kill -HUP" in cli.stderr
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 20) == 0


class HoldingGate:
    """Holds every request until it is cancelled, as the prefill policy holds a cold prompt."""

    def __init__(self) -> None:
        self.holding = asyncio.Event()

    async def admit(self, flight: Any, body: dict[str, Any]) -> None:
        flight.prefill.plan = PrefillPlan.HELD
        self.holding.set()
        await asyncio.Event().wait()


async def test_a_request_held_at_the_end_of_the_grace_gets_slotwise_s_503(
        fake_url: str, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = start_proxy(fake_url, listen={"shutdown_grace_s": 0.3})
    gate = HoldingGate()
    monkeypatch.setattr(proxy.app[ADMISSION], "admit", gate.admit)  # the scheduler holds it
    body = {"model": "fast", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    held = asyncio.create_task(asyncio.to_thread(http, "POST", proxy.url + "/v1/chat/completions",
                                                 body))
    await asyncio.to_thread(lambda: proxy.call(gate.holding.wait()))
    await asyncio.to_thread(proxy.stop)
    reply = await held
    assert reply.status_code == 503
    assert reply.json()["error"]["type"] == "slotwise_shutting_down"
    assert reply.headers["x-slotwise-error"] == "slotwise_shutting_down"
    (record,) = read_records(proxy)
    assert (record["status"], record["outcome"], record["prefill_plan"]) == (503, "shutdown", "held")
