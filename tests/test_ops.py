"""Operating slotwise against the fake upstream: config reload (valid, invalid, restart-only keys)
and SIGTERM on a real `slotwise serve` process. The real-server versions are in test_ops_real.py."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.lifecycle import Operations, reload_config
from proxy.runner import ProxyThread
from tests.fake_upstream import make_app
from tests.helpers import read_records, serve_app, start_proxy

SLOTWISE = Path(sys.executable).parent / "slotwise"
GRACE_S = 5  # listen.shutdown_grace_s of every proxy here: a reload may not change it


def write_config(path: Path, upstream: str, timing: Path, **tables: dict[str, Any]) -> Path:
    """A TOML config file: [upstream] url, [listen] port 0 and grace, [log] timing, + `tables`."""
    sections: dict[str, dict[str, Any]] = {
        "upstream": {"url": upstream}, "listen": {"port": 0, "shutdown_grace_s": GRACE_S},
        "log": {"timing": str(timing)}}
    for name, values in tables.items():
        sections[name] = {**sections.get(name, {}), **values}
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return orjson.dumps(value).decode()  # strings, numbers and booleans are spelled alike


@dataclass
class Served:
    """A `slotwise serve` subprocess and the lines of its log (stderr) so far."""

    process: subprocess.Popen[bytes]
    lines: list[str] = field(default_factory=list)
    url: str = ""

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no log line matching {pattern!r}; log:\n" + "".join(self.lines))

    def close(self) -> None:
        self.process.wait(10)
        self._reader.join(5)
        if self.process.stderr is not None:
            self.process.stderr.close()

    def start_reading(self) -> None:
        assert self.process.stderr is not None
        stream = self.process.stderr

        def read() -> None:
            for raw in stream:
                self.lines.append(raw.decode(errors="replace"))

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()


def serve(config: Path) -> Served:
    """Start `slotwise serve --config FILE`; return once it says where it listens."""
    process = subprocess.Popen([str(SLOTWISE), "serve", "--config", str(config)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    served = Served(process)
    served.start_reading()
    served.url = served.wait_for(r"slotwise listening on (http://\S+?),").group(1)
    return served


@pytest.fixture
def serving() -> Iterator[list[Served]]:
    """Started processes, killed at teardown if a test left one running."""
    started: list[Served] = []
    yield started
    for served in started:
        if served.process.poll() is None:
            served.process.kill()
        served.close()


@pytest.fixture
async def fake_url() -> AsyncIterator[str]:
    async with serve_app(make_app()) as url:
        yield url


def records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


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
def proxy(fake_url: str, tmp_path: Path) -> Iterator[ProxyThread]:
    running = start_proxy(fake_url, tmp_path, prefill={"max_hold_s": 30},
                          listen={"shutdown_grace_s": GRACE_S})
    yield running
    running.stop()


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
    moved = write_config(tmp_path / "moved.toml", fake_url, tmp_path / "elsewhere.jsonl",
                         prefill={"max_hold_s": 30})
    result = await reload_from(proxy, moved)
    assert not result.ok and "log.timing:" in result.message
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
    (rec,) = records(timing)
    assert rec["outcome"] == "done" and rec["events"] == 40
    assert "1 timing records written" in "".join(served.lines)


async def test_sigterm_cuts_what_outlives_the_grace_period_and_records_it(
        fake_url: str, tmp_path: Path, serving: list[Served]) -> None:
    timing = tmp_path / "timing.jsonl"
    config = write_config(tmp_path / "c.toml", fake_url, timing, listen={"shutdown_grace_s": 0.5})
    served = await asyncio.to_thread(serve, config)
    serving.append(served)
    started = asyncio.Event()
    running = asyncio.create_task(stream_chat(served.url, 400, started))
    await started.wait()
    t0 = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 20) == 0
    assert time.monotonic() - t0 < 5
    with pytest.raises(aiohttp.ClientPayloadError):
        await running
    (rec,) = records(timing)
    assert rec["outcome"] == "shutdown" and 0 < rec["events"] < 400
