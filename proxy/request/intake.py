"""Reads a request's body as the client sent it: the size limit, the JSON decode of a model request,
and its rewrite (the LoRA profile, the fields slotwise adds to measure).

It writes the intake's facts on the `Flight` (stream, bytes in, client, LoRA in and out) and returns
what to forward; deciding when it may go is the gate's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from proxy.record.flight import Flight
from proxy.request.errors import BadRequest, PayloadTooLarge
from proxy.request.relay import read_limited
from proxy.request.rewrite import Rewritten, client_key, rewrite_body


@dataclass(frozen=True)
class ModelBody:
    """A model request's body, decoded and rewritten."""

    rewritten: Rewritten
    data: bytes
    """The bytes to forward: the client's own unless the body was rewritten."""


class Intake:
    def __init__(self, request: web.Request, flight: Flight, max_body_bytes: int) -> None:
        self.request = request
        self.flight = flight
        self.max_body_bytes = max_body_bytes

    async def model_body(self, forced_lora: list[dict[str, Any]] | None) -> ModelBody:
        raw = await self._read()
        body = self._decode(raw)
        flight = self.flight
        flight.stream = body.get("stream") is True
        flight.client = client_key(body, flight.client)
        rewritten = rewrite_body(flight.kind, body, forced_lora=forced_lora)
        flight.lora_in, flight.lora_out = rewritten.lora_in, rewritten.lora_out
        flight.lora_rewritten = rewritten.lora_rewritten
        flight.progress_added = rewritten.progress_added
        return ModelBody(rewritten, orjson.dumps(rewritten.body) if rewritten.changed else raw)

    async def plain_body(self) -> Any:
        """A body slotwise need not read: streamed through when its length is known."""
        request = self.request
        if not request.body_exists:
            return None
        length = request.content_length
        if length is not None:
            if length > self.max_body_bytes:
                raise self._too_large(length)
            self.flight.bytes_in = length
            return request.content
        return await self._read()

    async def _read(self) -> bytes:
        length = self.request.content_length
        if length is not None and length > self.max_body_bytes:
            raise self._too_large(length)
        raw = await read_limited(self.request.content, self.max_body_bytes)
        if raw is None:
            raise self._too_large(None)
        self.flight.bytes_in = len(raw)
        return raw

    def _too_large(self, length: int | None) -> PayloadTooLarge:
        size = f"{length} bytes" if length is not None else "more"
        return PayloadTooLarge(f"the request body ({size}) is over the limit of "
                               f"{self.max_body_bytes} bytes (listen.max_body_mb)")

    def _decode(self, raw: bytes) -> dict[str, Any]:
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
