"""slotwise's own calls to llama-server, and the one retry they and forwarded requests share.

`UpstreamClient` is the one client for slotwise's own JSON calls (the tokenizer, `/props`, prefill
pieces, the LoRA adapter list, `/slots`): the current URL and key, a timeout per call, one error type.
`send` retries a request once when llama-server (cpp-httplib) had silently closed the kept-alive
connection it went out on: after a streamed response, or after a few seconds idle. aiohttp learns
that only when it writes the next request, so the request fails before the server could act on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import orjson

DEAD_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                   aiohttp.ClientPayloadError)
"""What a write on a connection the server already closed raises (`ClientConnectorError`, a
refused or unreachable server, is not one of them: it is raised at once)."""

ERROR_BODY_BYTES = 200
"""How much of an error answer's body an `UpstreamCallError` quotes."""


async def send(session: aiohttp.ClientSession, method: str, url: Any, *, replayable: bool = True,
               **kwargs: Any) -> aiohttp.ClientResponse:
    """`session.request(method, url, **kwargs)`, retried once after a dead pooled connection if
    `replayable`. Use the response as `async with await send(...) as response:`."""
    try:
        return await session.request(method, url, **kwargs)
    except aiohttp.ClientConnectorError:
        raise
    except DEAD_CONNECTION:
        if not replayable:
            raise
    return await session.request(method, url, **kwargs)


class UpstreamCallError(Exception):
    """One of slotwise's own calls got no usable answer; the message names the call and what went
    wrong. Each caller turns it into its own error (EstimateError, PieceError, ...)."""

    def __init__(self, message: str, *, status: int | None = None, public: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        """None: no answer (cannot connect, connection lost, timeout); else the HTTP status of
        the answer that could not be used (200 when its body is not JSON)."""
        self.public = message if public is None else public
        """What a client may be told: the call's path, never the upstream's URL or address."""


class UpstreamClient:
    """JSON calls to llama-server through the process's one session. The base URL and headers (the
    API key) are read per call, so a reload that changes them applies to the next call."""

    def __init__(self, session: aiohttp.ClientSession, base_url: Callable[[], str],
                 headers: Callable[[], Mapping[str, str]] = dict) -> None:
        self._session = session
        self._base_url = base_url
        self._headers = headers

    def aimed_at(self, base_url: str, headers: Mapping[str, str]) -> UpstreamClient:
        """The same session calling another URL with other headers (a config not yet in force)."""
        fixed = dict(headers)
        return UpstreamClient(self._session, lambda: base_url, lambda: fixed)

    async def get_json(self, path: str, *, timeout_s: float) -> Any:
        """The decoded JSON answer of `GET path`; UpstreamCallError unless HTTP 200 and JSON."""
        return await self._call("GET", path, None, timeout_s)

    async def post_json(self, path: str, body: Any, *, timeout_s: float) -> Any:
        """The decoded JSON answer of `POST path` with `body` as JSON; UpstreamCallError unless
        HTTP 200 and JSON."""
        return await self._call("POST", path, orjson.dumps(body), timeout_s)

    async def post_raw(self, path: str, body: Any, *, timeout_s: float) -> bytes:
        """The undecoded answer of `POST path` with `body` as JSON (the caller may look at its
        size before it decodes it); UpstreamCallError unless HTTP 200."""
        return await self._answer("POST", path, orjson.dumps(body), timeout_s)

    async def _call(self, method: str, path: str, data: bytes | None, timeout_s: float) -> Any:
        raw = await self._answer(method, path, data, timeout_s)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise UpstreamCallError(f"{method} {self._url(path)} answered with invalid JSON: {exc}",
                                    status=200, public=f"{method} {path} answered with invalid JSON"
                                    ) from exc

    async def _answer(self, method: str, path: str, data: bytes | None, timeout_s: float) -> bytes:
        status, raw = await self._exchange(method, path, data, timeout_s)
        if status != 200:
            said = f"answered HTTP {status}: {raw[:ERROR_BODY_BYTES].decode(errors='replace')}"
            raise UpstreamCallError(f"{method} {self._url(path)} {said}", status=status,
                                    public=f"{method} {path} {said}")
        return raw

    def _url(self, path: str) -> str:
        return self._base_url().rstrip("/") + path

    async def _exchange(self, method: str, path: str, data: bytes | None,
                        timeout_s: float) -> tuple[int, bytes]:
        # Identity: the session passes bytes on undecoded (auto_decompress=False).
        url = self._url(path)
        headers = {**self._headers(), "Accept-Encoding": "identity"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with await send(self._session, method, url, data=data, headers=headers,
                                  timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return response.status, await response.read()
        except TimeoutError as exc:
            why = f"failed: no answer within {timeout_s:g} s"
            raise UpstreamCallError(f"{method} {url} {why}", public=f"{method} {path} {why}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamCallError(f"{method} {url} failed: {type(exc).__name__}: {exc}",
                                    public=f"{method} {path} failed: {type(exc).__name__}") from exc
