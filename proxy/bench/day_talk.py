"""The messages of the day's conversations (pure, seeded: the same text on every path): a character
card or yesterday's history to begin with, each user message, the summary request, the prompt a
summary makes, a translation, and the request bodies a chat app sends."""

from __future__ import annotations

import random
import zlib
from typing import Any

from proxy.bench.day import PURPOSE, Act, DayPlan, Step, User
from proxy.bench.keep_run import history
from proxy.testbed.words import filler

Messages = list[dict[str, str]]

TOKENS_PER_WORD = 4.85
"""Tokens a filler word makes with the testbed's tokenizer (700 words ≈ 3,400 tokens)."""
GOOD_NIGHT, BYE = "Good night.", "Bye."
"""Yesterday's last turn, and the reply the app shows today (keep_kv's file holds the prefix)."""
SUMMARIZE = "Summarize the story so far in a few sentences."


def words(tokens: int) -> int:
    return max(1, round(tokens / TOKENS_PER_WORD))


def card(user: User, seed: int) -> str:
    rng = random.Random(f"{seed}-{user.name}-card")
    return f"You are the storyteller of {user.name}'s tale. " + filler(rng, words(user.card_tokens))


def opening(user: User, seed: int) -> Messages:
    """The conversation before the user's first step today."""
    if user.yesterday_tokens:
        return [*yesterday(user, seed), {"role": "assistant", "content": BYE}]
    return [{"role": "system", "content": card(user, seed)}]


def yesterday(user: User, seed: int) -> Messages:
    """The returning user's last turn of yesterday (history and the message), computed and saved
    through slotwise before llama-server restarts."""
    talk = history(hash_seed(seed, user.name), words(user.yesterday_tokens))
    return [*talk, {"role": "user", "content": GOOD_NIGHT}]


def hash_seed(seed: int, name: str) -> int:
    """A stable integer per user (Python's `hash` of a str changes between processes)."""
    return seed * 1000 + zlib.crc32(name.encode()) % 997


def message(user: User, seed: int, index: int) -> dict[str, str]:
    rng = random.Random(f"{seed}-{user.name}-{index}")
    return {"role": "user", "content": f"{user.name} {index}: {filler(rng, 6)}?"}


def summary_request(talk: Messages) -> Messages:
    return [*talk, {"role": "user", "content": SUMMARIZE}]


def folded(user: User, seed: int, talk: Messages, summary: str) -> Messages:
    """The conversation after the app applied the summary: the summary first, then the card, then
    the last exchange. The summary comes first because that is how the report saw these turns:
    the whole new prompt computed (13 turns a day, ~20k new tokens each)."""
    system = f"The story so far: {summary}\n\n{card(user, seed)}"
    return [{"role": "system", "content": system}, *talk[-2:]]


def translation(plan: DayPlan, index: int) -> Messages:
    rng = random.Random(f"{plan.seed}-translation-{index}")
    return [{"role": "system", "content": "Translate the user's text into French."},
            {"role": "user", "content": filler(rng, words(plan.translation_tokens))}]


def body(messages: Messages, step: Step, user: User) -> dict[str, Any]:
    """A streamed chat request as the app sends it: its replies run to `reply_tokens`."""
    out: dict[str, Any] = {"messages": messages, "stream": True, "max_tokens": step.reply_tokens,
                           "ignore_eos": True, "temperature": 0.8}
    if user.lora is not None:
        out["lora"] = [dict(entry) for entry in user.lora]
    return out


def yesterday_body(user: User, seed: int) -> dict[str, Any]:
    return body(yesterday(user, seed), Step(Act.CHAT, 0.0, reply_tokens=8), user)


EVENING_FOLLOW_UPS = 4
EVENING_REPLY = 24
"""Yesterday's chat: its follow-ups, each a short message after a reply of this many tokens."""


def evening_card(plan: DayPlan, user: User) -> Messages:
    """Yesterday's chat begins with a card of half keep_kv's `min_tokens`, so that the whole
    chat, its follow-ups and replies too, stays under it at the default scale (never saved: the
    day starts with the returning users' files only)."""
    rng = random.Random(f"{plan.seed}-{user.name}-evening")
    return [{"role": "system", "content": filler(rng, words(plan.keep_min_tokens() // 2))}]


def evening_step() -> Step:
    return Step(Act.CHAT, 0.0, reply_tokens=EVENING_REPLY)


def headers(user: User, act: Act, request_id: str) -> dict[str, str]:
    """What the app sends beside the body: who, what for, and an id slotwise keeps as its record's."""
    return {"X-Slotwise-Client": user.name, "X-Slotwise-Purpose": PURPOSE[act],
            "X-Request-Id": request_id}
