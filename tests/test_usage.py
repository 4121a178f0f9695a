"""`usage` in each API's terms: the prompt's total tokens and those the server computed."""

from __future__ import annotations

import pytest

from proxy.record.kind import Kind
from proxy.request.usage import prompt_counts


@pytest.mark.parametrize(("kind", "obj", "expected"), [
    # OpenAI chat: prompt_tokens is the total, cached_tokens the part found in the cache
    (Kind.CHAT, {"usage": {"prompt_tokens": 99, "prompt_tokens_details": {"cached_tokens": 98}}},
     (99, 1)),
    (Kind.COMPLETIONS, {"usage": {"prompt_tokens": 40}}, (40, None)),
    # OpenAI responses: input_tokens is the total
    (Kind.RESPONSES, {"usage": {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 10}}},
     (50, 40)),
    # Anthropic: input_tokens is only what was computed; cache reads come on top
    (Kind.MESSAGES, {"usage": {"input_tokens": 1, "cache_read_input_tokens": 98,
                               "output_tokens": 4}}, (99, 1)),
    (Kind.MESSAGES, {"usage": {"input_tokens": 5, "cache_creation_input_tokens": 3,
                               "cache_read_input_tokens": 2}}, (10, 8)),
    # an Anthropic stream says it in message_start; message_delta carries output tokens only
    (Kind.MESSAGES, {"type": "message_start", "message": {"usage": {
        "input_tokens": 99, "cache_read_input_tokens": 0, "output_tokens": 0}}}, (99, 99)),
    (Kind.MESSAGES, {"type": "message_delta", "usage": {"output_tokens": 4}}, (None, None)),
    # a responses stream says it in response.completed
    (Kind.RESPONSES, {"type": "response.completed", "response": {"usage": {
        "input_tokens": 183, "input_tokens_details": {"cached_tokens": 182}}}}, (183, 1)),
    (Kind.CHAT, {"choices": []}, (None, None)),
    (Kind.CHAT, {"usage": {"prompt_tokens": True}}, (None, None)),
])
def test_prompt_counts(kind: Kind, obj: dict, expected: tuple) -> None:  # type: ignore[type-arg]
    assert prompt_counts(kind, obj) == expected
