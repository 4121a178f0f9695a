"""An OpenAI `/v1/responses` body as the chat body llama-server makes of it, so that the chat
template (the server's `/apply-template`) gives the prompt it will compute. Pure.

Follows llama-server's `server_chat_convert_responses_to_chatcmpl`, as the build the testbed runs
does it, for the common items: the instructions, a text input, input and output messages (a
developer message becomes a system message of its own), function calls and their outputs,
reasoning. The conversion differs between llama.cpp versions (newer ones merge developer messages
into the first system message), so the estimator checks the result against the server's own
`/v1/responses/input_tokens`: a server that converts otherwise costs an estimate, never a wrong one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.estimate.prompt import NotEstimable

DROPPED = ("input", "instructions", "previous_response_id")
"""Body fields the conversion consumes; every other field passes on as it is."""


def responses_as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    if "input" not in body:
        raise NotEstimable("a responses body without 'input'")
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        instructions = body["instructions"]
        messages.append({"role": "system",
                         "content": instructions if isinstance(instructions, str) else ""})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                _item(messages, dict(item))
    else:
        raise NotEstimable("a responses 'input' that is neither text nor a list of items")
    chat = {k: v for k, v in body.items() if k not in DROPPED}
    chat["messages"] = messages
    if isinstance(body.get("tools"), list):
        chat["tools"] = [_tool(t) for t in body["tools"]]
    return chat


def _item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    after_assistant = bool(messages) and messages[-1].get("role") == "assistant"
    if isinstance(item.get("content"), str):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    role, kind = item.get("role"), item.get("type")
    if isinstance(item.get("content"), list) and role in ("user", "system", "developer"):
        parts = [_part(p) for p in item["content"] if isinstance(p, dict)]
        message = {k: v for k, v in item.items() if k not in ("type", "status")}
        message["content"] = [p for p in parts if p is not None]
        if role == "developer":
            message["role"] = "system"
        messages.append(message)
    elif role == "assistant" and kind == "message":
        content = item.get("content")
        texts = [{"text": p["text"], "type": "text"} for p in content if isinstance(p, dict)
                 and p.get("type") in ("output_text", "input_text")
                 and isinstance(p.get("text"), str)] if isinstance(content, list) else []
        if after_assistant:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"].extend(texts)
        else:
            message = {k: v for k, v in item.items() if k not in ("type", "status")}
            message["content"] = texts
            messages.append(message)
    elif kind == "function_call" and all(isinstance(item.get(k), str)
                                         for k in ("arguments", "call_id", "name")):
        call = {"type": "function", "id": item["call_id"],
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if after_assistant:
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": [], "tool_calls": [call]})
    elif kind == "function_call_output" and isinstance(item.get("call_id"), str) \
            and isinstance(item.get("output"), str):
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": item["output"]})
    elif kind == "reasoning" and isinstance(item.get("summary"), list):
        text = _reasoning_text(item.get("content"))
        if after_assistant:
            messages[-1]["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": text})


def _part(part: dict[str, Any]) -> dict[str, Any] | None:
    if part.get("type") == "input_text" and "text" in part:
        return {"text": part["text"], "type": "text"}
    if part.get("type") == "input_image" and "image_url" in part:
        return {"image_url": {"url": part["image_url"]}, "type": "image_url"}
    return None


def _reasoning_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict) \
            and isinstance(content[0].get("text"), str):
        return str(content[0]["text"])
    return ""


def _tool(tool: Any) -> Any:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}
