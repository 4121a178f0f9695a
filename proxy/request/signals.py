"""What a stream event means, for each kind of endpoint: a progress report, a token, the final
timings, the end, an error. Pure: one decoded event in, one `Signal` out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.record.kind import Kind
from proxy.request.sse import SseEvent
from proxy.request.usage import prompt_counts


class What(enum.Enum):
    NOTHING = "nothing"  # a comment, a ping, a role-only delta, the usage chunk without timings
    PROGRESS = "progress"  # a `prompt_progress` chunk slotwise or the client asked for
    TOKEN = "token"  # an event that carries generated text
    DONE = "done"  # the `[DONE]` sentinel
    ERROR = "error"  # an `{"error": …}` event from the server
    MALFORMED = "malformed"  # data that is not JSON


@dataclass(frozen=True, slots=True)
class Signal:
    what: What
    progress: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    prompt_tokens: int | None = None  # from `usage`, when the event carries it
    computed_tokens: int | None = None  # the prompt tokens computed (not cached), from `usage`
    error: str | None = None
    final: bool = False  # the native final object (`stop: true`)


NOTHING = Signal(What.NOTHING)
DONE = Signal(What.DONE)


def interpret(kind: Kind, event: SseEvent) -> Signal:
    """What one event of a `kind` stream says."""
    if event.data is None:
        return NOTHING
    if event.data == b"[DONE]":
        return DONE
    try:
        obj = orjson.loads(event.data)
    except orjson.JSONDecodeError:
        return Signal(What.MALFORMED, error=f"invalid JSON in a stream event: {event.data[:80]!r}")
    if not isinstance(obj, dict):
        return Signal(What.MALFORMED, error="a stream event that is not a JSON object")
    if obj.get("error"):
        return Signal(What.ERROR, error=_error_text(obj["error"]))
    timings = obj.get("timings")
    timings = timings if isinstance(timings, dict) else None
    progress = obj.get("prompt_progress")
    if isinstance(progress, dict):
        return Signal(What.PROGRESS, progress=progress, timings=timings)
    has_text = _HAS_TEXT.get(kind, _any_data)(obj)
    prompt_tokens, computed_tokens = prompt_counts(kind, obj)
    return Signal(
        What.TOKEN if has_text else What.NOTHING,
        timings=timings,
        prompt_tokens=prompt_tokens,
        computed_tokens=computed_tokens,
        final=obj.get("stop") is True,
    )


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _choices(obj: dict[str, Any]) -> list[dict[str, Any]]:
    choices = obj.get("choices")
    return [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []


def _chat_text(obj: dict[str, Any]) -> bool:
    for choice in _choices(obj):
        delta = choice.get("delta")
        if isinstance(delta, dict) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        ):
            return True
    return False


def _completions_text(obj: dict[str, Any]) -> bool:
    return any(choice.get("text") for choice in _choices(obj))


def _native_text(obj: dict[str, Any]) -> bool:
    return bool(obj.get("content"))


def _messages_text(obj: dict[str, Any]) -> bool:
    return obj.get("type") == "content_block_delta"


def _responses_text(obj: dict[str, Any]) -> bool:
    kind = obj.get("type")
    return isinstance(kind, str) and kind.endswith(".delta")


def _any_data(obj: dict[str, Any]) -> bool:
    return True


_HAS_TEXT = {
    Kind.CHAT: _chat_text,
    Kind.COMPLETIONS: _completions_text,
    Kind.COMPLETION: _native_text,
    Kind.INFILL: _native_text,
    Kind.MESSAGES: _messages_text,
    Kind.RESPONSES: _responses_text,
}
