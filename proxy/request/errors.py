"""The proxy's own errors, grouped by what the client should do, and the one place they become an
HTTP answer (`error_response`: the OpenAI-shaped body, the status, `X-Slotwise-Error`).

Upstream error responses are never turned into these: they pass through unchanged. These are for what
slotwise itself decides or meets (bad input, an unreachable upstream, a full queue). Every
`ProxyError` of every feature is defined here.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.record.outcome import Outcome
from proxy.request.headers import REQUEST_ID_HEADER

PROXY_ERROR_HEADER = "X-Slotwise-Error"


class ProxyError(Exception):
    """An error slotwise answers itself. `status` and `type` go into the response."""

    status = 500
    type = "slotwise_error"
    outcome = Outcome.PROXY_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": f"slotwise: {self.message}", "type": self.type,
                          "code": self.status}}

    def body_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def headers(self) -> dict[str, str]:
        """Headers the answer needs besides the body (a 401's challenge)."""
        return {}


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"
    outcome = Outcome.BAD_REQUEST


class PayloadTooLarge(BadRequest):
    status = 413


class BodyTimeout(BadRequest):
    """The client did not send its whole body within `listen.body_timeout_s`."""

    status = 408


class Unauthorized(ProxyError):
    """No key, or not a key slotwise knows (`[access] clients`, `[upstream] api_key`)."""

    status = 401
    type = "authentication_error"
    outcome = Outcome.UNAUTHORIZED

    def __init__(self, message: str, *, challenge: str) -> None:
        super().__init__(message)
        self.challenge = challenge

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": self.challenge}


class Forbidden(ProxyError):
    """An admin endpoint `[access]` does not allow, or a page that is off."""

    status = 403
    type = "permission_error"
    outcome = Outcome.FORBIDDEN


class UpstreamUnavailable(ProxyError):
    """The upstream cannot be reached, refused, or reset the connection."""

    status = 502
    type = "slotwise_upstream_unavailable"
    outcome = Outcome.UPSTREAM_ERROR


class UpstreamTimeout(ProxyError):
    status = 504
    type = "slotwise_upstream_timeout"
    outcome = Outcome.UPSTREAM_ERROR


class BadUpstreamStream(ProxyError):
    """The upstream's stream broke off or could not be understood after it started."""

    status = 502
    type = "slotwise_bad_upstream_stream"
    outcome = Outcome.UPSTREAM_ERROR


class Rejected(ProxyError):
    """The policy turned the request away (too many waiting); the client may retry later."""

    status = 503
    type = "slotwise_overloaded"
    outcome = Outcome.REJECTED


class ShuttingDown(ProxyError):
    """slotwise is stopping and the shutdown grace period is over: the request is cut (a stream
    gets this as its last event, a request without an answer yet as its answer)."""

    status = 503
    type = "slotwise_shutting_down"
    outcome = Outcome.SHUTDOWN


class LoraNotReady(ProxyError):
    """A model request in mode fixed/none while the profile cannot be built (upstream not read yet,
    or it no longer has the configured adapters): refused rather than run with the wrong adapters."""

    status = 503
    type = "slotwise_lora_not_ready"
    outcome = Outcome.UPSTREAM_ERROR


class NotReady(ProxyError):
    """The upstream cannot answer a render now (down, restarting, loading its model)."""

    status = 503
    type = "slotwise_not_ready"
    outcome = Outcome.UPSTREAM_ERROR


class TooManyWarmUps(ProxyError):
    """A warm-up the `[warm]` bounds do not let in."""

    status = 429
    type = "slotwise_too_many_warmups"
    outcome = Outcome.REJECTED


class WarmOff(Rejected):
    """`warm.enabled` is false."""


class NoSuchWarmUp(ProxyError):
    """A warm-up id that never was or has expired, or an endpoint that cannot be warmed."""

    status = 404
    type = "not_found_error"
    outcome = Outcome.BAD_REQUEST


def error_headers(error: ProxyError, request_id: str | None = None) -> dict[str, str]:
    """The headers of slotwise's answer with `error`: what it is (`X-Slotwise-Error`), never cached,
    the error's own (a 401's challenge), and the request's id when it has one."""
    headers = {PROXY_ERROR_HEADER: error.type, "Cache-Control": "no-store", **error.headers()}
    if request_id is not None:
        headers[REQUEST_ID_HEADER] = request_id
    return headers


def error_response(error: ProxyError, request_id: str | None = None) -> web.Response:
    """The one way slotwise answers with its own error: status, headers, OpenAI-shaped body."""
    return web.Response(status=error.status, body=error.body_bytes(), content_type="application/json",
                        headers=error_headers(error, request_id))


def sse_error_event(error: ProxyError) -> bytes:
    """How an error is told to a client whose stream has already started (as llama-server does)."""
    return b"data: " + error.body_bytes() + b"\n\n"
