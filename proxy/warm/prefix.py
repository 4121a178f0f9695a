"""Which part of a body's prompt a warm-up computes, and when two prompts are one conversation. Pure.

A chat-like body (chat, Anthropic messages, OpenAI responses) is rendered twice with the server's own
template: the conversation without the generation prompt, and the conversation with one more user
message and the generation prompt, as the user's turn will be. Their common prefix is what every next
turn starts with, whatever the template does at the end of a conversation (a last assistant message
left open to be continued, reasoning dropped from earlier turns, the generation prompt): that is
the longest stable prefix, and what a warm-up computes. A completion body's prompt is its own
prefix: the next turn appends to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from proxy.estimate.anthropic import messages_as_chat
from proxy.estimate.prompt import CHAT_KINDS, COMPLETION_KINDS, MESSAGES_KINDS, RESPONSES_KINDS, NotEstimable
from proxy.estimate.responses import responses_as_chat

WARM_KINDS = CHAT_KINDS | COMPLETION_KINDS | MESSAGES_KINDS | RESPONSES_KINDS
"""The endpoint kinds a warm-up takes: every kind the estimator handles."""
PROBE = {"role": "user", "content": "Hello"}
"""The stand-in for the user's next message (only the prefix the two renders share is kept)."""
SAME_SHARE = 0.9
"""A prompt belongs to a warm-up's conversation when it starts with at least this share of the
warm-up's prefix. The turn normally carries all of it; the slack keeps a prompt that changed a few
tokens near the end (a client that trims the last message) in the conversation, while one that
shares only a system prompt with it is another conversation."""
COMPARE_BLOCK = 256


def chat_renders(kind: str, body: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two chat bodies to render for a chat-like body: the conversation so far without the
    generation prompt, and the same with a next user message and the generation prompt.
    NotEstimable when the body has no conversation to warm."""
    if kind in MESSAGES_KINDS:
        chat = messages_as_chat(body)
    elif kind in RESPONSES_KINDS:
        chat = responses_as_chat(body)
    elif kind in CHAT_KINDS:
        chat = dict(body)
    else:
        raise NotEstimable(f"a {kind} body has no conversation to render")
    messages = chat.get("messages")
    if not isinstance(messages, list) or not messages:
        raise NotEstimable("the body has no messages to warm (valid: the conversation so far, "
                           "at least one message)")
    chat.pop("continue_final_message", None)
    so_far = {**chat, "add_generation_prompt": False}
    turn = {**chat, "messages": [*messages, dict(PROBE)], "add_generation_prompt": True}
    return so_far, turn


def is_chat_like(kind: str) -> bool:
    return kind in CHAT_KINDS | MESSAGES_KINDS | RESPONSES_KINDS


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids two prompts share (blocks compared at once, then id by id; any two
    sequences of ints: a list and an array compare by their values)."""
    end = min(len(a), len(b))
    i = 0
    while i + COMPARE_BLOCK <= end and tuple(a[i:i + COMPARE_BLOCK]) == tuple(b[i:i + COMPARE_BLOCK]):
        i += COMPARE_BLOCK
    while i < end and a[i] == b[i]:
        i += 1
    return i


def same_conversation(common: int, warm_tokens: int) -> bool:
    """Whether a prompt sharing `common` leading ids with a warm-up's prefix of `warm_tokens` is of
    its conversation."""
    return warm_tokens > 0 and common >= SAME_SHARE * warm_tokens
