"""The connector of the one upstream session: aiohttp's TCP connector, except that an answer which
cannot have a body (204, 304) is read as the answer it is even when bytes follow its head.

llama-server's `/cors-proxy` relays a 204 as a chunked stream and so writes the chunked terminator
`0\\r\\n\\r\\n` after the head (llama.cpp's `test_mcp_proxy_no_content`). RFC 9112 6.3: a 204 or 304
ends with its head, so those bytes belong to no answer; aiohttp's parser takes them for the next
answer's status line and fails the whole read, losing the 204. Clients of llama-server that read HTTP
as the RFC says (Python's http.client, browsers) see the 204; so does a client of slotwise now.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Any, cast

import aiohttp
from aiohttp.client_proto import ResponseHandler

_BODILESS_HEAD = re.compile(rb"HTTP/1\.[01] (?:204|304)[ \r]")


def bodiless_head_end(data: bytes) -> int | None:
    """Where the head of a 204 or 304 answer at the start of `data` ends (after its blank line);
    None if `data` does not start with a whole one. Pure."""
    if not _BODILESS_HEAD.match(data):
        return None
    end = data.find(b"\r\n\r\n")
    return end + 4 if end >= 0 else None


class BodilessAnswers(ResponseHandler):
    """aiohttp's protocol for one upstream connection. Bytes after a 204's or 304's head are dropped,
    also those that come later, and the connection is closed once the answer is read, never pooled
    (where they come in a later read, a pooled connection would fail the next request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._dropping = False

    def data_received(self, data: bytes) -> None:
        if self._dropping:  # what followed a bodiless answer: part of no answer
            return
        end = bodiless_head_end(data)
        if end is not None:
            self._dropping = True
            self.force_close()
            data = data[:end]
        super().data_received(data)


class UpstreamConnector(aiohttp.TCPConnector):
    """`aiohttp.TCPConnector` making `BodilessAnswers` protocols."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        factory = functools.partial(BodilessAnswers, loop=self._loop)
        self._factory = cast("functools.partial[ResponseHandler]", factory)
