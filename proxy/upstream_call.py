"""Sends one request to llama-server, once more on a new connection if a kept-alive one was dead.

llama-server (cpp-httplib) closes a kept-alive connection on its side without telling the client:
after a streamed response, and when the connection has been idle for a few seconds. aiohttp learns
it only when it writes the next request on that pooled connection, so the request fails before the
server could act on it. A request whose body can be sent again is then retried once.
"""

from __future__ import annotations

from typing import Any

import aiohttp

DEAD_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                   aiohttp.ClientPayloadError)
"""What a write on a connection the server already closed raises (`ClientConnectorError`, a
refused or unreachable server, is not one of them: it is raised at once)."""


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
