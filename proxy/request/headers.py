"""Which headers cross the proxy, each way, as a reverse proxy should pass them.

Hop-by-hop headers stay on their hop; slotwise's own request headers (`X-Slotwise-*`) are read and
removed; every request gets an `X-Request-Id` (the client's own, made safe and unique), sent upstream
and returned to the client.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

from proxy.record.clientstrings import clean_id, clean_text

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "trailers", "transfer-encoding", "upgrade",
})
CLIENT_HEADER = "X-Slotwise-Client"
PURPOSE_HEADER = "X-Slotwise-Purpose"
REQUEST_ID_HEADER = "X-Request-Id"
ROUTER_CLIENT_HEADERS = ("X-User-Id", "X-Session-Id")
"""The keys routers use for stickiness (vllm-router's consistent_hash, sticky_least_loaded): the
record's `client` when neither `X-Slotwise-Client` nor the body's `user` names one."""


def client_request_id(incoming: Mapping[str, str]) -> str | None:
    """The client's own `X-Request-Id`, made a safe token (`proxy/record/ids.py` makes it unique)."""
    return clean_id(incoming.get(REQUEST_ID_HEADER))


def router_client(incoming: Mapping[str, str]) -> str | None:
    """`X-User-Id`, else `X-Session-Id`, made safe like the client header; None if neither."""
    for name in ROUTER_CLIENT_HEADERS:
        value = clean_text(incoming.get(name))
        if value:
            return value
    return None


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """Headers named in `Connection:` are hop-by-hop too (RFC 9110 7.6.1)."""
    value = headers.get("Connection", "")
    return {token.strip().lower() for token in value.split(",") if token.strip()}


def _passable(items: Iterable[tuple[str, str]], drop: set[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in items if k.lower() not in drop)


def upstream_request_headers(incoming: Mapping[str, str], items: Iterable[tuple[str, str]], *,
                             rid: str, peer: str | None, scheme: str,
                             body_rewritten: bool, measured: bool) -> CIMultiDict[str]:
    """Headers to send upstream.

    `body_rewritten`: the body is re-encoded, so the client's Content-Length is stale. `measured`:
    slotwise parses the response, so it asks for it uncompressed (the client accepts that too).
    """
    drop = set(HOP_BY_HOP) | _connection_tokens(incoming)
    drop |= {"host", CLIENT_HEADER.lower(), PURPOSE_HEADER.lower(), REQUEST_ID_HEADER.lower()}
    if body_rewritten:
        drop.add("content-length")
    if measured:
        drop.add("accept-encoding")
    headers = _passable(items, drop)
    headers[REQUEST_ID_HEADER] = rid
    if peer:
        prior = incoming.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    headers.setdefault("X-Forwarded-Proto", scheme)
    if "Host" in incoming:
        headers.setdefault("X-Forwarded-Host", incoming["Host"])
    return headers


def client_response_headers(upstream: Mapping[str, str], items: Iterable[tuple[str, str]], *,
                            rid: str, keep_length: bool) -> CIMultiDict[str]:
    """Headers to send back: the upstream's, less hop-by-hop, with the request id."""
    drop = set(HOP_BY_HOP) | _connection_tokens(upstream)
    if not keep_length:
        drop.add("content-length")
    headers = _passable(items, drop)
    headers[REQUEST_ID_HEADER] = rid
    return headers
