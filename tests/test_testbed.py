"""Tests of the testbed: the model file, the binary lookup, the CLI, and a real llama-server serving
the tiny model (chat via the openai package, one stream event per token, a LoRA that matters)."""

from __future__ import annotations

import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import gguf
import openai
import orjson
import pytest

from proxy.cli import main
from proxy.testbed import binary
from proxy.testbed.binary import BinaryError, find_llama_server
from proxy.testbed.model import ModelFiles, write_model
from proxy.testbed.server import LlamaServer, ServerStartError
from tests.conftest import StartLlamaServer

# --- the model file -------------------------------------------------------------------------------


def test_model_is_byte_identical_for_a_seed(tmp_path: Path) -> None:
    first = write_model(tmp_path / "a", "tiny", seed=7)
    again = write_model(tmp_path / "b", "tiny", seed=7)
    other = write_model(tmp_path / "c", "tiny", seed=8)
    assert first.model.read_bytes() == again.model.read_bytes()
    assert first.lora.read_bytes() == again.lora.read_bytes()
    assert first.model.read_bytes() != other.model.read_bytes()


def test_model_metadata_matches_the_testbed_design(tiny_model: ModelFiles) -> None:
    reader = gguf.GGUFReader(tiny_model.model)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ"  # GPT-2 byte spelling
    assert tokens[eos] == "<|im_end|>"
    assert {"<|im_start|>", "<|endoftext|>"} <= set(tokens)
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert "<|im_start|>assistant" in reader.fields["tokenizer.chat_template"].contents()
    assert reader.fields["llama.context_length"].contents() >= 32768


def test_unknown_preset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        write_model(tmp_path, "huge")


# --- finding the binary -----------------------------------------------------------------------


def _fake_executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_explicit_binary_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _fake_executable(tmp_path / "mine" / "llama-server")
    _fake_executable(tmp_path / "bin" / "llama-server")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("SLOTWISE_LLAMA_SERVER", str(mine))
    assert find_llama_server(build=False) == mine


def test_binary_on_path_comes_before_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_path = _fake_executable(tmp_path / "bin" / "llama-server")
    _fake_executable(tmp_path / "cache" / "llama-server" / "11434.0.0" / "llama-server")
    monkeypatch.delenv("SLOTWISE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setenv("SLOTWISE_CACHE_DIR", str(tmp_path / "cache"))
    assert find_llama_server(build=False) == on_path


def test_cached_binary_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cached = _fake_executable(tmp_path / "c" / "llama-server" / "11434.0.0" / "llama-server")
    monkeypatch.delenv("SLOTWISE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("SLOTWISE_CACHE_DIR", str(tmp_path / "c"))
    assert find_llama_server(build=False) == cached


def test_explicit_binary_that_is_missing_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTWISE_LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(BinaryError, match=r"SLOTWISE_LLAMA_SERVER=.*nope is not an executable"):
        find_llama_server()


def test_missing_compiler_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLOTWISE_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no cmake, no compiler
    monkeypatch.setenv("SLOTWISE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(BinaryError, match="missing cmake, a C\\+\\+ compiler"):
        find_llama_server()


# --- the CLI ----------------------------------------------------------------------------------


def test_cli_model_prints_the_written_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["testbed", "model", str(tmp_path), "--preset", "tiny", "--seed", "3"]) == 0
    printed = [Path(line) for line in capsys.readouterr().out.splitlines()]
    assert [path.name for path in printed] == ["slotwise-tiny-s3.gguf", "slotwise-tiny-s3-lora.gguf"]
    assert all(path.stat().st_size > 0 for path in printed)


def test_cli_rejects_a_negative_seed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["testbed", "model", str(tmp_path), "--seed", "-1"]) == 1
    assert "--seed must be non-negative" in capsys.readouterr().err


# --- a real server ----------------------------------------------------------------------------


@pytest.mark.real_server
def test_chat_completion_with_the_openai_client(start_llama_server: StartLlamaServer) -> None:
    server = start_llama_server(args=["-np", "1", "-c", "2048"])
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused") as client:
        reply = client.chat.completions.create(
            model="testbed",
            messages=[{"role": "user", "content": "Say something."}],
            max_tokens=24,
        )
    text = reply.choices[0].message.content or ""
    assert text.strip() and text.isprintable()
    assert reply.choices[0].finish_reason == "length"  # no early end of text
    assert reply.usage is not None and reply.usage.completion_tokens == 24


@pytest.mark.real_server
def test_a_reply_sent_back_is_found_whole_in_the_next_turn(
        start_llama_server: StartLlamaServer, small_model: ModelFiles) -> None:
    """A trained model's tokens are the tokenizer's own, so a chat's next turn, which repeats the
    reply as text, finds all of it cached; the testbed model's replies must too (sampled from
    every byte and merge, 3 of 8 were found whole, and slotwise's estimate of follow-ups was
    tested on a server unlike any real one). The small model, the benchmarks'."""
    server = start_llama_server(small_model, lora=False, args=["-np", "1", "-c", "4096"])
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused") as client:
        for i in range(6):
            talk = [{"role": "user", "content": f"Tell me about the sea, part {i}."}]
            first = client.chat.completions.create(model="testbed", messages=talk,  # type: ignore[arg-type]
                                                   max_tokens=40, temperature=1.0)
            assert first.usage is not None
            talk += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "And then?"}]
            again = client.chat.completions.create(model="testbed", messages=talk,  # type: ignore[arg-type]
                                                   max_tokens=1)
            cached = again.model_extra["timings"]["cache_n"]  # type: ignore[index]
            # the prompt and the reply, but its last token, which was sampled and never decoded
            assert cached == first.usage.prompt_tokens + 40 - 1, i


@pytest.mark.real_server
async def test_stream_sends_one_event_per_token(start_llama_server: StartLlamaServer) -> None:
    server = start_llama_server(lora=False, args=["-np", "1", "-c", "2048"])
    events = await _completion_stream(server, {"prompt": "Once upon a time", "n_predict": 40})
    content = [event for event in events if event.get("content")]
    final = events[-1]
    assert final["stop"] is True
    assert final["timings"]["predicted_n"] == 40
    assert len(content) == final["timings"]["predicted_n"]
    assert "".join(event["content"] for event in content).isprintable()


@pytest.mark.real_server
async def test_lora_scale_changes_the_output(start_llama_server: StartLlamaServer) -> None:
    server = start_llama_server(args=["-np", "1", "-c", "2048"])

    async def generate(scale: float) -> str:
        body = {"prompt": "The weather today", "n_predict": 24, "temperature": 0,
                "lora": [{"id": 0, "scale": scale}]}  # fmt: skip
        events = await _completion_stream(server, body)
        return "".join(event.get("content", "") for event in events)

    without, with_lora, without_again = await generate(0.0), await generate(1.0), await generate(0.0)
    assert without == without_again  # greedy decoding is repeatable, so a difference means LoRA
    assert with_lora != without


@pytest.mark.real_server
def test_log_has_prefix_and_timestamps_whatever_the_environment(
    start_llama_server: StartLlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The log analysers need the prefix; a user's LLAMA_ARG_* must not switch it off.
    monkeypatch.setenv("LLAMA_ARG_LOG_PREFIX", "false")
    monkeypatch.setenv("LLAMA_ARG_LOG_TIMESTAMPS", "false")
    server = start_llama_server(lora=False, args=["-np", "1", "-c", "2048"])
    lines = server.log_path.read_text().splitlines()
    prefixed = [line for line in lines if re.match(r"\d+\.\d{2}\.\d{3}\.\d{3} [IWED] ", line)]
    assert any("initializing, n_slots = 1" in line for line in prefixed)


@pytest.mark.real_server
def test_server_that_cannot_load_the_model_reports_its_log(llama_server_binary: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file")
    server = LlamaServer(broken, binary=llama_server_binary, log_path=tmp_path / "server.log")
    with pytest.raises(ServerStartError, match="exited with code") as failure:
        server.start()
    assert str(server.log_path) in str(failure.value)
    assert server.pid is None  # stopped, nothing left running


async def _completion_stream(server: LlamaServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{server.url}/completion", json={**body, "stream": True}) as response,
    ):
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: "):
                events.append(orjson.loads(line.removeprefix(b"data: ")))
    return events


def test_failed_build_points_to_its_log_and_caches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = tmp_path / "tools"
    for name in ("cc", "c++"):
        _fake_executable(tools / name)
    (tools / "cmake").write_text("#!/bin/sh\necho 'CMake Error: no way'\nexit 1\n")
    (tools / "cmake").chmod(0o755)
    monkeypatch.setattr(binary, "_fetch_source", lambda work, log, log_path: tmp_path)
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    target = tmp_path / "cache" / "llama-server"
    with pytest.raises(BinaryError, match=r"cmake configure failed .*build\.log(.|\n)*no way"):
        binary.build_llama_server(target)
    assert not target.exists()


def test_concurrent_callers_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[Path] = []

    def fake_compile(source: Path, build: Path, log: object, log_path: Path) -> Path:
        builds.append(build)
        time.sleep(0.2)  # long enough for the other caller to queue on the lock
        return _fake_executable(build / "bin" / "llama-server")

    monkeypatch.setattr(binary, "_check_toolchain", lambda: None)
    monkeypatch.setattr(binary, "_fetch_source", lambda work, log, log_path: tmp_path)
    monkeypatch.setattr(binary, "_compile", fake_compile)
    target = tmp_path / "cache" / "llama-server"
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: binary.build_llama_server(target), range(2)))
    assert results == [target, target] and len(builds) == 1
    assert os.access(target, os.X_OK)
    assert not list(target.parent.glob(".build-*"))  # the work dir is gone
