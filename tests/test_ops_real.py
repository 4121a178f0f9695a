"""Operating a real `slotwise serve` in front of a real llama-server: a reload that switches the
LoRA mode mid-stream, reloads that are refused, and SIGTERM during a stream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.testbed.server import LlamaServer
from tests.helpers import read_records
from tests.served import SLOTWISE, Served, serve, write_config

pytestmark = pytest.mark.real_server


@pytest.fixture(scope="module")
def server(llama_server_binary: Path, tiny_model: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(tiny_model.model, lora=tiny_model.lora, args=["-np", "2", "-c", "8192"],
                     binary=llama_server_binary, log_path=log) as running:
        yield running


async def chat(url: str, tokens: int, started: asyncio.Event | None = None,
               stream: bool = True) -> bytes:
    body = {"model": "m", "stream": stream, "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story about ships."}]}
    chunks = []
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for chunk in response.content.iter_any():
            chunks.append(chunk)
            if started is not None and b'"content"' in chunk:
                started.set()
    return b"".join(chunks)


async def start(config: Path, serving: list[Served]) -> Served:
    served = await asyncio.to_thread(serve, config)
    serving.append(served)
    return served


async def test_a_reload_switches_the_lora_mode_for_the_next_request_not_the_running_stream(
        server: LlamaServer, tmp_path: Path, serving: list[Served]) -> None:
    timing = tmp_path / "timing.jsonl"
    config = write_config(tmp_path / "slotwise.toml", server.url, timing,
                          lora={"mode": "passthrough"})
    served = await start(config, serving)
    started = asyncio.Event()
    running = asyncio.create_task(chat(served.url, 1500, started))
    await started.wait()
    write_config(config, server.url, timing, lora={"mode": "none"})
    served.process.send_signal(signal.SIGHUP)
    await asyncio.to_thread(served.wait_for, "config reloaded from .*generation 2")
    assert not running.done()
    await chat(served.url, 4, stream=False)
    body = await running
    assert body.endswith(b"data: [DONE]\n\n")
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 30) == 0
    # started first; the new request's `lora` differs, so it may wait for the stream to end
    old, new = sorted(read_records(timing), key=lambda r: r["start"])
    assert (old["config_gen"], old["outcome"], old["events"]) == (1, "done", 1500)
    assert old["lora_rewritten"] is False and old["lora_out"] is None
    assert (new["config_gen"], new["outcome"]) == (2, "done")
    assert new["lora_rewritten"] is True and new["lora_out"] == [{"id": 0, "scale": 0.0}]


async def test_refused_reloads_change_nothing_and_say_why(
        server: LlamaServer, tmp_path: Path, serving: list[Served]) -> None:
    timing = tmp_path / "timing.jsonl"
    config = write_config(tmp_path / "slotwise.toml", server.url, timing)
    served = await start(config, serving)
    # a file that does not parse: refused by the process, the log says why
    write_config(config, server.url, timing, lora={"mode": "sometimes"})
    served.process.send_signal(signal.SIGHUP)
    line = (await asyncio.to_thread(served.wait_for, "config reload refused.*")).group(0)
    assert "generation 1 stays in force" in line
    assert "lora.mode: unknown mode 'sometimes' (valid: passthrough, fixed, none)" in line
    # `slotwise reload` checks the file first and sends nothing
    cli = await asyncio.to_thread(reload_cli, config, served.url)
    assert cli.returncode == 2 and "nothing was reloaded" in cli.stderr
    # an adapter this server does not have: valid TOML, refused by the LoRA check
    write_config(config, server.url, timing,
                 lora={"mode": "fixed", "adapters": [{"name": "nope.gguf"}]})
    cli = await asyncio.to_thread(reload_cli, config, served.url)
    assert cli.returncode == 1 and "reload refused, generation 1 stays" in cli.stderr
    assert "nope.gguf" in cli.stderr
    await chat(served.url, 3)
    # and a good one is taken
    write_config(config, server.url, timing, lora={"mode": "none"})
    cli = await asyncio.to_thread(reload_cli, config, served.url)
    assert cli.returncode == 0 and "generation 2 in force" in cli.stdout
    await chat(served.url, 3)
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 30) == 0
    assert [r["config_gen"] for r in read_records(timing)] == [1, 2]


def reload_cli(config: Path, url: str) -> subprocess.CompletedProcess[str]:
    """`slotwise reload`; the config listens on port 0, so it is told the URL."""
    return subprocess.run([str(SLOTWISE), "reload", "--config", str(config), "--url", url],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NO_COLOR": "1"})


async def test_sigterm_during_a_stream_lets_it_finish_and_leaves_one_record_per_request(
        server: LlamaServer, tmp_path: Path, serving: list[Served]) -> None:
    timing = tmp_path / "timing.jsonl"
    served = await start(write_config(tmp_path / "slotwise.toml", server.url, timing), serving)
    await chat(served.url, 4, stream=False)
    started = asyncio.Event()
    running = asyncio.create_task(chat(served.url, 600, started))  # well within the grace
    await started.wait()
    served.process.send_signal(signal.SIGTERM)
    await asyncio.to_thread(served.wait_for, "slotwise stopping: 1 requests in flight")
    with pytest.raises(aiohttp.ClientConnectionError):
        await chat(served.url, 1)
    body = await running
    assert body.endswith(b"data: [DONE]\n\n")
    assert await asyncio.to_thread(served.process.wait, 30) == 0
    recs = read_records(timing)
    assert [r["outcome"] for r in recs] == ["done", "done"]
    assert recs[1]["events"] == 600 and len({r["id"] for r in recs}) == 2
    assert "2 timing records written" in "".join(served.lines)
