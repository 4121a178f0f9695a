"""The estimate against a real llama-server: the tokenizers give exactly the prompt tokens the server
computes for the same request, and the cache model's prediction matches the server's cache_n."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from proxy.config import PrefillConfig
from proxy.estimate import (
    CacheModel,
    EstimateError,
    LocalTokenizer,
    PromptTokenizer,
    UpstreamTokenizer,
    estimate,
)
from proxy.estimate.anthropic import messages_as_chat
from proxy.estimate.responses import responses_as_chat
from proxy.estimate.tokenizer import COUNT_PATHS
from proxy.prefill.estimator import Estimator
from proxy.prefill.layout import layout_advice
from proxy.testbed.model import ModelFiles
from proxy.upstream import UpstreamClient
from tests.conftest import StartLlamaServer

pytestmark = pytest.mark.real_server

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there, how are you?"}]},
    {"messages": [
        {"role": "system", "content": "You are a pirate. Speak like one."},
        {"role": "user", "content": "Tell me about the sea " * 40},
        {"role": "assistant", "content": "Arr, the sea be wide."},
        {"role": "user", "content": "And <|im_start|> special tokens, ünïcödé, 日本語 and emoji 🦜?"},
    ]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"},
                                               {"type": "text", "text": " of content"}]}],
     "temperature": 0.5},
]

COMPLETIONS: list[Any] = [
    "Once upon a time, <|im_start|>user in a land far away",
    ["lead text ", 300, 301, " and more text"],
    [17, 18, 19, 20],
    {"prompt_string": "an object prompt"},
]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def tokenizers(session: aiohttp.ClientSession, url: str,
                     model: ModelFiles) -> list[PromptTokenizer]:
    upstream = UpstreamTokenizer(UpstreamClient(session, lambda: url))
    if not HAS_LLAMA_CPP:
        return [upstream]
    return [upstream, await LocalTokenizer.open(str(model.model), upstream)]


@pytest.mark.parametrize("chat", range(len(CHATS)))
async def test_chat_estimate_equals_server_prompt_tokens(
        chat: int, start_llama_server: StartLlamaServer, tiny_model: ModelFiles,
        session: aiohttp.ClientSession) -> None:
    server = start_llama_server(lora=False)
    body = CHATS[chat]
    found = [await t.tokenize_request("chat", body)
             for t in await tokenizers(session, server.url, tiny_model)]
    answer = await post(session, server.url + "/v1/chat/completions",
                        {**body, "max_tokens": 1, "cache_prompt": False})
    assert answer["usage"]["prompt_tokens"] == len(found[0])
    timings = answer["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == len(found[0])
    assert all(ids == found[0] for ids in found)


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif -%}"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif -%}"
    "{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments }}"
    "</call>{% endfor -%}"
    "{%- if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)
"""A chat template that renders what a /v1/messages body turns into: tools, tool calls with their
arguments, tool results with their ids, reasoning. The testbed's own template ignores them."""

MESSAGES: list[dict[str, Any]] = [
    {"system": "You are terse.", "messages": [{"role": "user", "content": "Hello"}]},
    {"system": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Use tools."}],
     "tools": [{"name": "weather", "description": "Weather now",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
     "tool_choice": {"type": "auto"},
     "messages": [
         {"role": "user", "content": "Weather in Oslo and Tromsø?"},
         {"role": "assistant", "content": [
             {"type": "thinking", "thinking": "Two calls."},
             {"type": "text", "text": "Checking."},
             {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
             {"type": "tool_use", "id": "t2", "name": "weather",
              "input": {"city": "Tromsø", "units": {"temp": "C", "wind": "m/s"}}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "t1", "content": "rain, 4 C"},
             {"type": "tool_result", "tool_use_id": "t2",
              "content": [{"type": "text", "text": "snow, "}, {"type": "text", "text": "-3 C"}]},
             {"type": "text", "text": "Thanks. And tomorrow?"}]}]},
]


def tool_template_server(start_llama_server: StartLlamaServer, tmp_path: Any) -> Any:
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
    return start_llama_server(lora=False, args=["--jinja", "--chat-template-file", str(template)])


async def assert_counted_alike(session: aiohttp.ClientSession, server: Any, model: ModelFiles,
                               kind: str, body: dict[str, Any]) -> None:
    """Every tokenizer finds the ids whose number the server counts for the body with its own
    conversion (a real call with tools needs a tool-call grammar this model's vocabulary cannot
    build; the count takes the same path up to the template)."""
    found = [await t.tokenize_request(kind, body)
             for t in await tokenizers(session, server.url, model)]
    counted = await post(session, server.url + COUNT_PATHS[kind], body)
    assert counted["input_tokens"] == len(found[0])
    assert all(ids == found[0] for ids in found)


@pytest.mark.parametrize("case", range(len(MESSAGES)))
async def test_anthropic_messages_estimate_equals_server_prompt_tokens(
        case: int, start_llama_server: StartLlamaServer, tiny_model: ModelFiles,
        session: aiohttp.ClientSession, tmp_path: Any) -> None:
    server = tool_template_server(start_llama_server, tmp_path)
    body = {"model": "m", "max_tokens": 1, **MESSAGES[case]}
    await assert_counted_alike(session, server, tiny_model, "messages", body)
    prompt = (await post(session, server.url + "/apply-template",
                         {"messages": [], **messages_as_chat(body)}))["prompt"]
    if case == 1:  # the template did render the converted tool calls and results
        assert '<call>weather {"city":"Tromsø","units":{"temp":"C","wind":"m/s"}}</call>' in prompt
        assert "snow, -3 C [t2]" in prompt and "<think>Two calls.</think>" in prompt


RESPONSES: list[dict[str, Any]] = [
    {"input": "Hello"},
    {"instructions": "Be brief.",
     "tools": [{"type": "function", "name": "weather", "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
     "input": [
         {"role": "developer", "content": "Answer in Norwegian."},
         {"role": "user", "content": "Weather in Oslo?"},
         {"type": "function_call", "call_id": "c1", "name": "weather",
          "arguments": '{"city":"Oslo"}'},
         {"type": "function_call_output", "call_id": "c1", "output": "rain"},
         {"type": "message", "role": "assistant",
          "content": [{"type": "output_text", "text": "It rains."}]},
         {"role": "user", "content": [{"type": "input_text", "text": "Tomorrow?"}]}]},
]


@pytest.mark.parametrize("case", range(len(RESPONSES)))
async def test_responses_estimate_equals_server_prompt_tokens(
        case: int, start_llama_server: StartLlamaServer, tiny_model: ModelFiles,
        session: aiohttp.ClientSession, tmp_path: Any) -> None:
    server = tool_template_server(start_llama_server, tmp_path)
    body = {"model": "m", **RESPONSES[case]}
    await assert_counted_alike(session, server, tiny_model, "responses", body)
    if case == 1:  # the template did render the converted items
        prompt = (await post(session, server.url + "/apply-template",
                             responses_as_chat(body)))["prompt"]
        assert '<call>weather {"city":"Oslo"}</call>' in prompt and "rain [c1]" in prompt
        assert "<|im_start|>systemAnswer in Norwegian." in prompt  # developer: a system message


async def test_a_messages_body_the_server_counts_otherwise_is_not_estimated(
        start_llama_server: StartLlamaServer, session: aiohttp.ClientSession) -> None:
    """slotwise's conversion is checked against the server's own count: a block type the server
    renders but slotwise would not (simulated by a count that cannot match) fails the estimate."""
    server = start_llama_server(lora=False)
    upstream = UpstreamTokenizer(UpstreamClient(session, lambda: server.url))
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    tokens = len(await upstream.tokenize_request("messages", body))
    with pytest.raises(EstimateError, match=f"makes {tokens + 1} prompt tokens.*counts {tokens}"):
        await upstream.check_count("messages", body, tokens + 1)


@pytest.mark.parametrize("prompt", range(len(COMPLETIONS)))
async def test_completion_estimate_equals_server_prompt_tokens(
        prompt: int, start_llama_server: StartLlamaServer, tiny_model: ModelFiles,
        session: aiohttp.ClientSession) -> None:
    server = start_llama_server(lora=False)
    body = {"prompt": COMPLETIONS[prompt], "n_predict": 1, "cache_prompt": False}
    found = [await t.tokenize_request("completion", body)
             for t in await tokenizers(session, server.url, tiny_model)]
    answer = await post(session, server.url + "/completion", body)
    assert answer["tokens_evaluated"] == len(found[0])
    assert all(ids == found[0] for ids in found)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (slotwise[gguf])")
async def test_local_tokenizer_matches_server_tokenize_on_long_text(
        start_llama_server: StartLlamaServer, tiny_model: ModelFiles,
        session: aiohttp.ClientSession) -> None:
    server = start_llama_server(lora=False)
    upstream = UpstreamTokenizer(UpstreamClient(session, lambda: server.url))
    local = await LocalTokenizer.open(str(tiny_model.model), upstream)
    text = "".join(f"line {i}: <|im_end|> the quick brown fox ü 🦊\n" for i in range(1500))
    body = {"prompt": text}
    assert await local.tokenize_request("completion", body) == await upstream.tokenize(text)


async def test_cache_model_predicts_server_cache_n(
        start_llama_server: StartLlamaServer, session: aiohttp.ClientSession) -> None:
    server = start_llama_server(lora=False, args=["-np", "2"])
    upstream = UpstreamTokenizer(UpstreamClient(session, lambda: server.url))
    cache = CacheModel(n_slots=2, n_ctx=4096)
    turn = [{"role": "user", "content": "Tell me a long story about a lighthouse. " * 30}]
    for reply in ("The keeper woke early.", "Storms came in the night."):
        body = {"messages": turn, "max_tokens": 1}
        ids = await upstream.tokenize_request("chat", body)
        est = estimate(ids, cache)
        timings = (await post(session, server.url + "/v1/chat/completions", body))["timings"]
        assert est.prompt_tokens == timings["prompt_n"] + timings["cache_n"]
        # Block granularity: the model may know up to one block less than the server.
        assert 0 <= timings["cache_n"] - est.cached_tokens < 64
        cache.record(ids, timings["cache_n"])
        turn = [*turn, {"role": "assistant", "content": reply},
                {"role": "user", "content": "Go on."}]


async def test_pieces_extend_the_cached_prefix(
        start_llama_server: StartLlamaServer, session: aiohttp.ClientSession) -> None:
    """The chunk plan's mechanics: id prefixes with n_predict 0 each find the previous one cached,
    and the real chat request then finds the fed prefix cached, as the cache model predicts."""
    server = start_llama_server(lora=False)
    upstream = UpstreamTokenizer(UpstreamClient(session, lambda: server.url))
    body = {"messages": [{"role": "user", "content": "a cold prompt " * 400}], "max_tokens": 1}
    ids = await upstream.tokenize_request("chat", body)
    cache = CacheModel(n_slots=4, n_ctx=8192)
    for upto in (256, 512, 768):
        piece = {"prompt": ids[:upto], "n_predict": 0, "response_fields": ["timings"]}
        timings = (await post(session, server.url + "/completion", piece))["timings"]
        assert timings["cache_n"] == cache.estimate_cached(ids[:upto])
        cache.record(ids[:upto], timings["cache_n"])
    timings = (await post(session, server.url + "/v1/chat/completions", body))["timings"]
    assert timings["cache_n"] == estimate(ids, cache).cached_tokens == 768



@pytest.mark.parametrize(("args", "few_slots", "shared"), [
    (["-np", "2", "-c", "8192"], True, False), (["-np", "4", "-c", "16384"], False, False),
    (["-np", "4", "-kvu"], False, True), (["-np", "-1"], False, True)])
async def test_chunk_mode_warns_once_about_a_layout_that_costs_it(
        args: list[str], few_slots: bool, shared: bool, start_llama_server: StartLlamaServer,
        session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    server = start_llama_server(lora=False, args=args)
    estimator = Estimator(UpstreamClient(session, lambda: server.url))
    body = {"messages": [{"role": "user", "content": "Hello"}]}
    with caplog.at_level(logging.WARNING, logger="slotwise.prefill"):
        for _ in range(2):
            await estimator.estimate(PrefillConfig(mode="chunk"), "chat", body)
    warnings = [r.getMessage() for r in caplog.records]
    assert len([w for w in warnings if "slot(s)" in w]) == few_slots
    assert len([w for w in warnings if "one KV pool shared by the slots" in w]) == shared
    assert estimator.layout.shared_kv is shared
    assert layout_advice("defer", estimator.layout) == layout_advice("off", estimator.layout) == []
