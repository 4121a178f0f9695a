"""A fake llama-server for the faults a real one cannot be made to show on demand: a reset
mid-stream, a garbled event, silence. The body's `model` field picks the behaviour.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import orjson
from aiohttp import web


def _chunk(text: str, finish: str | None = None) -> bytes:
    obj: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": text} if text else {},
                                        "finish_reason": finish}],
                           "object": "chat.completion.chunk", "id": "chatcmpl-fake"}
    if finish:
        obj["timings"] = {"prompt_n": 5, "cache_n": 0, "prompt_ms": 1.0,
                          "predicted_n": 1, "predicted_ms": 1.0}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    behaviour = body.get("model", "fast")
    tokens = int(body.get("max_tokens", 20))
    if behaviour == "silent":
        await asyncio.sleep(3600)
    if not body.get("stream"):
        return web.json_response({"choices": [{"message": {"content": "x" * tokens}}],
                                  "timings": {"prompt_n": 5, "cache_n": 0, "prompt_ms": 1.0,
                                              "predicted_n": tokens, "predicted_ms": 2.0}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(tokens):
        if behaviour == "reset" and i == tokens // 2:
            assert request.transport is not None
            sock = request.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            request.transport.abort()
            return response
        if behaviour == "garbled" and i == tokens // 2:
            await response.write(b"data: {\"choices\": [{\"delta\": {\"content\": \"tr\n\n")
            continue
        await response.write(_chunk("tok"))
        if behaviour == "slow":
            await asyncio.sleep(0.05)
    await response.write(_chunk("", "stop"))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def echo(request: web.Request) -> web.Response:
    data = await request.read()
    return web.json_response({"method": request.method, "path": request.path,
                              "raw_path": request.raw_path, "length": len(data),
                              "headers": dict(request.headers)})


def make_app() -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app
