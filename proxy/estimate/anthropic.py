"""An Anthropic `/v1/messages` body as the chat body llama-server makes of it, so that the chat
template (the server's `/apply-template`) gives the prompt it will compute. Pure.

Follows llama-server's `server_chat_convert_anthropic_to_oai` (tools/server/server-chat.cpp) for
everything that reaches the template: the system prompt, the messages with their text, thinking,
image, tool_use and tool_result blocks, the tools, `tool_choice`, `chat_template_kwargs`. The
estimator checks the result against the server's own `/v1/messages/count_tokens`, so a server
that converts differently costs an estimate, never a wrong one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proxy.estimate.prompt import NotEstimable

BILLING_HEADER = "x-anthropic-billing-header:"
"""Claude Code's first system line; the server blanks its per-request `cch=` hash (5 characters)
so that the prompt cache gets past it."""


def messages_as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise NotEstimable("a messages body without a 'messages' array")
    out: list[Any] = []
    system = body.get("system")
    if isinstance(system, str):
        out.append({"role": "system", "content": _normalize_billing(system)})
    elif isinstance(system, list):
        text = "".join(_normalize_billing(_str(b.get("text"))) for b in system
                       if isinstance(b, dict) and b.get("type") == "text")
        out.append({"role": "system", "content": text})
    for message in messages:
        out.extend(_message(message))
    chat: dict[str, Any] = {"messages": out}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [_tool(t) for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "auto":
        chat["tool_choice"] = "auto"
    elif isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
        chat["tool_choice"] = "required"
    if "chat_template_kwargs" in body:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat


def _message(message: Any) -> list[Any]:
    if not isinstance(message, dict):
        return [message]
    if "content" not in message:
        return [] if message.get("role") == "assistant" else [message]
    content = message["content"]
    if not isinstance(content, list):
        return [message]
    parts: list[Any] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(block)
        elif kind == "thinking":
            reasoning += _str(block.get("thinking"))
        elif kind == "image":
            url = _image_url(block.get("source"))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            calls.append({"id": _str(block.get("id")), "type": "function", "function": {
                "name": _str(block.get("name")),
                "arguments": _dump({} if block.get("input") is None else block["input"])}})
        elif kind == "tool_result":
            results.append(_tool_result(block))
    out: list[Any] = []
    if parts or calls or reasoning:
        converted: dict[str, Any] = {"role": message.get("role", ""), "content": parts or ""}
        if calls:
            converted["tool_calls"] = calls
        if reasoning:
            converted["reasoning_content"] = reasoning
        out.append(converted)
    return out + results


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"role": "tool", "tool_call_id": _str(block.get("tool_use_id"))}
    content = block.get("content")
    if isinstance(content, str):
        return {**result, "content": content}
    if not isinstance(content, list):
        return {**result, "content": ""}
    text, images = "", False
    parts: list[dict[str, Any]] = []
    for item in content:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            text += _str(item.get("text"))
            parts.append({"type": "text", "text": _str(item.get("text"))})
        elif kind == "image":
            images = True
            url = _image_url(item.get("source"))
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    return {**result, "content": parts if images else text}


def _tool(tool: Any) -> dict[str, Any]:
    tool = tool if isinstance(tool, dict) else {}
    return {"type": "function", "function": {
        "name": _str(tool.get("name")), "description": _str(tool.get("description")),
        "parameters": tool.get("input_schema", {})}}


def _image_url(source: Any) -> str | None:
    if not isinstance(source, dict):
        return None
    if source.get("type") == "base64":
        media = source.get("media_type")
        media = media if isinstance(media, str) else "image/jpeg"
        return f"data:{media};base64,{_str(source.get('data'))}"
    if source.get("type") == "url":
        return _str(source.get("url"))
    return None


def _normalize_billing(text: str) -> str:
    if not text.startswith(BILLING_HEADER):
        return text
    at = text.find("cch=", len(BILLING_HEADER))
    start = at + 4
    if at < 0 or start + 5 >= len(text) or text[start + 5] != ";":
        return text
    return text[:start] + "fffff" + text[start + 5:]


def _dump(value: Any) -> str:
    """The server's `json::dump()`: compact, keys in their order, UTF-8 as is."""
    return orjson.dumps(value).decode()


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""
