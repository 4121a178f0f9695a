"""The proxy's own errors, grouped by what the client should do, and their OpenAI-shaped bodies.

Upstream error responses are never turned into these: they pass through unchanged. These are for what
slotwise itself decides or meets (bad input, an unreachable upstream, a full queue).
"""

from __future__ import annotations

from typing import Any

import orjson

PROXY_ERROR_HEADER = "X-Slotwise-Error"


class ProxyError(Exception):
    """An error slotwise answers itself. `status` and `type` go into the response."""

    status = 500
    type = "slotwise_error"
    outcome = "proxy_error"

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
    outcome = "bad_request"


class PayloadTooLarge(BadRequest):
    status = 413


class BodyTimeout(BadRequest):
    """The client did not send its whole body within `listen.body_timeout_s`."""

    status = 408


class Unauthorized(ProxyError):
    """No key, or not a key slotwise knows (`[access] clients`, `[upstream] api_key`)."""

    status = 401
    type = "authentication_error"
    outcome = "unauthorized"

    def __init__(self, message: str, *, challenge: str) -> None:
        super().__init__(message)
        self.challenge = challenge

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": self.challenge}


class Forbidden(ProxyError):
    """An admin endpoint `[access]` does not allow, or a page that is off."""

    status = 403
    type = "permission_error"
    outcome = "forbidden"


class UpstreamUnavailable(ProxyError):
    """The upstream cannot be reached, refused, or reset the connection."""

    status = 502
    type = "slotwise_upstream_unavailable"
    outcome = "upstream_error"


class UpstreamTimeout(ProxyError):
    status = 504
    type = "slotwise_upstream_timeout"
    outcome = "upstream_error"


class BadUpstreamStream(ProxyError):
    """The upstream's stream broke off or could not be understood after it started."""

    status = 502
    type = "slotwise_bad_upstream_stream"
    outcome = "upstream_error"


class Rejected(ProxyError):
    """The policy turned the request away (too many waiting); the client may retry later."""

    status = 503
    type = "slotwise_overloaded"
    outcome = "rejected"


class ShuttingDown(ProxyError):
    """slotwise is stopping and the shutdown grace period is over: the request is cut (a stream
    gets this as its last event, a request without an answer yet as its answer)."""

    status = 503
    type = "slotwise_shutting_down"
    outcome = "shutdown"


def sse_error_event(error: ProxyError) -> bytes:
    """How an error is told to a client whose stream has already started (as llama-server does)."""
    return b"data: " + error.body_bytes() + b"\n\n"
