"""Reads a request's body as the client sent it: the size limit, the JSON decode of a model request,
and its rewrite (the LoRA profile, the fields slotwise adds to measure).

It writes the intake's facts on the `Flight` (stream, bytes in, client, LoRA in and out) and returns
what to forward; deciding when it may go is the gate's job.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.record.flight import Flight
from proxy.request.errors import BadRequest, BodyTimeout, PayloadTooLarge
from proxy.request.headers import router_client
from proxy.request.relay import read_limited
from proxy.request.rewrite import Rewritten, client_key, rewrite_body


@dataclass(frozen=True)
class ModelBody:
    """A model request's body, decoded and rewritten."""

    rewritten: Rewritten
    data: bytes
    """The bytes to forward: the client's own unless the body was rewritten."""


class BodyReader:
    """A request's body within `listen.max_body_mb` and `listen.body_timeout_s` (counted from when
    the reader is made): read whole, or as it comes, and decoded as one JSON object. Also how
    slotwise's own endpoints that take a body (render) read it."""

    def __init__(self, request: web.Request, max_body_bytes: int, body_timeout_s: float) -> None:
        self.request = request
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.deadline = asyncio.get_running_loop().time() + body_timeout_s
        """The whole body must be in by then (the loop's clock)."""
        self.too_slow: BodyTimeout | None = None
        """Set when the body missed the deadline (also while it was being streamed upstream)."""

    async def read(self) -> bytes:
        """The whole body: PayloadTooLarge over the limit, BodyTimeout after the deadline."""
        length = self.request.content_length
        if length is not None and length > self.max_body_bytes:
            raise self._too_large(length)
        try:
            async with asyncio.timeout_at(self.deadline):
                raw = await read_limited(self.request.content, self.max_body_bytes)
        except TimeoutError:
            raise self._slow() from None
        if raw is None:
            raise self._too_large(None)
        return raw

    async def _timed(self, content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
        """The body as it comes, each read within the deadline (aiohttp's client sends it on)."""
        while True:
            try:
                async with asyncio.timeout_at(self.deadline):
                    chunk = await content.readany()
            except TimeoutError:
                raise self._slow() from None
            if not chunk:
                return
            yield chunk

    def _slow(self) -> BodyTimeout:
        self.too_slow = BodyTimeout(f"the request body did not arrive within {self.body_timeout_s:g} s "
                                    "(listen.body_timeout_s)")
        return self.too_slow

    def _too_large(self, length: int | None) -> PayloadTooLarge:
        size = f"{length} bytes" if length is not None else "more"
        return PayloadTooLarge(f"the request body ({size}) is over the limit of "
                               f"{self.max_body_bytes} bytes (listen.max_body_mb)")

    def decode(self, raw: bytes) -> dict[str, Any]:
        """The body as a JSON object, else BadRequest saying what it is instead."""
        where = f"{self.request.method} {self.request.path}"
        if not raw.strip():
            raise BadRequest(f"{where} needs a JSON object as its body; the body is empty")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the body of {where} is not valid JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise BadRequest(f"the body of {where} must be a JSON object, "
                             f"got a JSON {type(body).__name__}")
        return body


class Intake(BodyReader):
    def __init__(self, request: web.Request, flight: Flight, max_body_bytes: int,
                 body_timeout_s: float) -> None:
        super().__init__(request, max_body_bytes, body_timeout_s)
        self.flight = flight

    async def model_body(self, forced_lora: list[dict[str, Any]] | None) -> ModelBody:
        raw = await self._read()
        body = self.decode(raw)
        flight = self.flight
        flight.stream = body.get("stream") is True
        flight.client = (client_key(body, flight.client, flight.kind)
                         or router_client(self.request.headers))
        rewritten = rewrite_body(flight.kind, body, forced_lora=forced_lora)
        flight.lora_in, flight.lora_out = rewritten.lora_in, rewritten.lora_out
        flight.lora_rewritten = rewritten.lora_rewritten
        flight.progress_added = rewritten.progress_added
        return ModelBody(rewritten, orjson.dumps(rewritten.body) if rewritten.changed else raw)

    async def plain_body(self) -> Any:
        """A body slotwise need not read: streamed through when its length is known."""
        request = self.request
        self.flight.client = self.flight.client or router_client(request.headers)
        if not request.body_exists:
            return None
        length = request.content_length
        if length is not None:
            if length > self.max_body_bytes:
                raise self._too_large(length)
            self.flight.bytes_in = length
            return self._timed(request.content)
        return await self._read()

    async def _read(self) -> bytes:
        raw = await self.read()
        self.flight.bytes_in = len(raw)
        return raw
