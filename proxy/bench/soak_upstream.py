"""The soak's fake llama-server: OpenAI-shaped chat streams and answers, and the faults a real one
cannot be made to show on demand (a reset, a garbled event, silence, an error). The body's `model`
picks the behaviour; `max_tokens` the length. Served on loopback by the soak itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

import orjson
from aiohttp import web

TIMINGS = {"prompt_n": 5, "cache_n": 0, "prompt_ms": 1.0, "predicted_n": 1, "predicted_ms": 1.0}
GAPS_S = {"fast": 0.0, "slow": 0.02, "long": 0.25}
"""Seconds between tokens of each streaming behaviour."""
BEHAVIOURS = ("fast", "slow", "long", "plain", "reset", "garbled", "silent", "error")


def chunk(text: str, finish: str | None = None) -> bytes:
    """One chat stream event; the last one carries the timings."""
    obj: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": text} if text else {},
                                        "finish_reason": finish}],
                           "object": "chat.completion.chunk", "id": "chatcmpl-soak"}
    if finish:
        obj["timings"] = TIMINGS
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    behaviour = body.get("model", "fast")
    tokens = int(body.get("max_tokens", 20))
    if behaviour == "silent":
        await asyncio.sleep(3600)
    if behaviour == "error":
        return web.json_response({"error": {"code": 500, "message": "soak: a made-up failure",
                                            "type": "server_error"}}, status=500)
    if behaviour == "plain" or not body.get("stream"):
        return web.json_response({"choices": [{"message": {"content": "x" * tokens}}],
                                  "timings": {**TIMINGS, "predicted_n": tokens}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    with contextlib.suppress(ConnectionResetError):  # slotwise, for a client that left, went away
        await _stream(request, response, behaviour, tokens)
    return response


async def _stream(request: web.Request, response: web.StreamResponse, behaviour: str,
                  tokens: int) -> None:
    gap = GAPS_S.get(behaviour, 0.0)
    for i in range(tokens):
        if i == tokens // 2 and behaviour == "reset":
            _reset(request)
            return
        if i == tokens // 2 and behaviour == "garbled":
            await response.write(b'data: {"choices": [{"delta": {"content": "tr\n\n')
            continue
        await response.write(chunk("tok"))
        if gap:
            await asyncio.sleep(gap)
    await response.write(chunk("", "stop"))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


def _reset(request: web.Request) -> None:
    """Abort the connection with a TCP reset, as a crashing server's kernel would."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def other(request: web.Request) -> web.Response:
    data = await request.read()
    return web.json_response({"path": request.path, "length": len(data)})


def make_app() -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_route("*", "/{tail:.*}", other)
    return app
