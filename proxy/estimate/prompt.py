"""Which prompt a request body carries, before any tokenizer is asked: pure shape rules.

Mirrors llama-server's `tokenize_input_prompts` / `tokenize_mixed` (tools/server/server-common.cpp):
a string, an id array, a mixed array, `{"prompt_string": ...}`, or a one-element array of those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

CHAT_KINDS = frozenset({"chat"})
"""Kinds whose prompt is the chat template applied to `messages` (OpenAI chat body)."""
COMPLETION_KINDS = frozenset({"completion", "completions"})
"""Kinds whose body carries `prompt` (native `/completion`, OpenAI `/v1/completions`)."""
MESSAGES_KINDS = frozenset({"messages"})
"""Anthropic `/v1/messages`: the server turns the body into a chat body first."""
RESPONSES_KINDS = frozenset({"responses"})
"""OpenAI `/v1/responses`: likewise."""

Prompt = str | list[str | int]
"""A single prompt as the server tokenizes it: text, or a list of ids and text pieces."""


class EstimateError(Exception):
    """The prompt's tokens cannot be known ahead; the caller forwards as it came (fail open)."""


class NotEstimable(EstimateError):
    """The request's shape is not one slotwise can tokenize exactly (the message says why)."""


class PromptTooLong(NotEstimable):
    """The prompt has more tokens than one slot of the server holds: the server cannot take it, so
    slotwise neither renders nor warms it (its ids are not even decoded when the count shows it)."""

    def __init__(self, tokens: int, slot_ctx: int) -> None:
        super().__init__(f"the prompt is {tokens:,} tokens, more than the {slot_ctx:,} one slot of "
                         "the server holds (llama-server's n_ctx per slot)")
        self.tokens = tokens
        self.slot_ctx = slot_ctx


def check_fits(tokens: int, limit: int | None) -> None:
    """PromptTooLong when `tokens` is over `limit` (one slot's context; None: not known)."""
    if limit is not None and tokens > limit:
        raise PromptTooLong(tokens, limit)


def _types(values: Sequence[Any]) -> set[type]:
    """The types of a JSON array's items, collected in C: a Python loop over the millions of ids
    of a large prompt held the event loop for a second (`bool` is a type of its own: not an id)."""
    return set(map(type, values))


def completion_prompt(body: Mapping[str, Any]) -> Prompt:
    """The one prompt of a completion body; NotEstimable for several prompts or multimodal data."""
    if "prompt" not in body:
        raise NotEstimable("the body has no 'prompt'")
    return _single(body["prompt"])


def _single(prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if "multimodal_data" in prompt:
            raise NotEstimable("a multimodal prompt")
        if "prompt_string" not in prompt:
            raise NotEstimable("a prompt object without 'prompt_string'")
        return _single_text_or_mixed(prompt["prompt_string"])
    if isinstance(prompt, list):
        if int in _types(prompt):
            return _single_text_or_mixed(prompt)
        if len(prompt) == 1:
            return _single(prompt[0])
        raise NotEstimable(f"{len(prompt)} prompts in one request")
    raise NotEstimable(f"a prompt of type {type(prompt).__name__}")


def _single_text_or_mixed(prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and _types(prompt) <= {int, str}:
        return list(prompt)
    raise NotEstimable("a prompt array may hold only token ids and strings")


def given_ids(prompt: Prompt) -> list[int] | None:
    """The ids when the prompt is a pure id array (used as given: no BOS, no tokenizer)."""
    if isinstance(prompt, list) and _types(prompt) <= {int}:
        return cast(list[int], list(prompt))
    return None


def tokenize_mixed(prompt: Prompt, tokenize: Callable[[str, bool], list[int]]) -> list[int]:
    """llama-server's `tokenize_mixed`: `tokenize(text, add_special)` with special-token parsing;
    add_special only for a string prompt or a string first element."""
    if isinstance(prompt, str):
        return tokenize(prompt, True)
    ids: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            ids.extend(tokenize(part, i == 0))
        else:
            ids.append(part)
    return ids


def check_kind(kind: str) -> None:
    if kind not in CHAT_KINDS | COMPLETION_KINDS | MESSAGES_KINDS | RESPONSES_KINDS:
        raise NotEstimable(f"requests of kind {kind!r} are not estimated")


def ids_of(values: Sequence[Any]) -> list[int]:
    """Validate a tokenizer's answer: a list of ints."""
    if not _types(values) <= {int}:
        raise EstimateError("the tokenizer answered something other than token ids")
    return values if isinstance(values, list) else list(values)
