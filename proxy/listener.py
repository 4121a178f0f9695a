"""The listening side's limits: how many client connections may be open, how long a client may take
to send a request's headers, how long a kept-alive connection may sit idle, and which requests are
being handled (so a shutdown can wait for them, then cut what outlives its grace).

aiohttp times only "no complete request head since the connection opened or the last response";
each connection's protocol is therefore wrapped in a `GuardedConnection`, which sees every byte
arrive, and a middleware tells it when a request's head is in (its handler starts) and when its
response is done. A connection over `listen.max_connections` is answered 503 here, before aiohttp
reads anything of it: no request was read, so it leaves no timing record; the log says how many.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Awaitable, Callable
from typing import cast

from aiohttp import web

from proxy.config import ListenConfig
from proxy.request.errors import Rejected, error_headers

log = logging.getLogger("slotwise")

LINGER_S = 2.0
"""How long a refused connection may go on sending (its request) before it is closed."""
WARN_EVERY_S = 10.0
"""At most one log line per this many seconds about refused connections."""
CUT_WAIT_S = 5.0
"""After the shutdown grace: how long the requests cut get to end and write their records."""
BACKLOG = 1024
"""Connections the kernel may queue before slotwise accepts them (aiohttp's default is 128)."""
FILES_BESIDES_CONNECTIONS = 64
"""Open files slotwise needs besides its client and upstream connections (log, listening socket,
slotwise's own calls upstream, the interpreter's own)."""


def refusal(max_connections: int) -> bytes:
    """The whole HTTP answer to a connection over the limit: slotwise's OpenAI-shaped 503."""
    error = Rejected(f"too many open connections (listen.max_connections = {max_connections}); "
                     "try again shortly")
    body = error.body_bytes()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)),
               **error_headers(error), "Retry-After": "1", "Connection": "close"}
    head = "HTTP/1.1 503 Service Unavailable\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    return head.encode("ascii") + body


class Listener:
    """The connections open now and the requests being handled, under the `[listen]` limits."""

    def __init__(self, limits: ListenConfig) -> None:
        self.limits = limits
        self.connections: set[GuardedConnection] = set()
        self.requests: set[asyncio.Task[object]] = set()
        self.refused = 0
        self._refused_logged = 0
        self._warned_at = -WARN_EVERY_S

    def apply(self, limits: ListenConfig) -> None:
        """A reload: the new limits hold for what happens from now on."""
        self.limits = limits

    def protocol_factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """What the listening socket makes for each new connection: `make()`'s protocol, guarded."""
        return lambda: GuardedConnection(self, make)

    def admit(self, connection: GuardedConnection, now: float) -> bool:
        """Count a new connection in, or refuse it if the limit is reached."""
        if len(self.connections) < self.limits.max_connections:
            self.connections.add(connection)
            return True
        self.refused += 1
        if now - self._warned_at >= WARN_EVERY_S:
            log.warning("connection limit reached (%d open, listen.max_connections): %d new "
                        "connections answered 503 since the last such line", len(self.connections),
                        self.refused - self._refused_logged)
            self._warned_at, self._refused_logged = now, self.refused
        return False

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        """Marks a request's handling: its connection's timers stop meanwhile; a shutdown waits
        for it."""
        transport = request.transport
        connection = transport.get_protocol() if transport is not None else None
        guarded = connection if isinstance(connection, GuardedConnection) else None
        task = asyncio.current_task()
        if guarded is not None:
            guarded.request_started()
        if task is not None:
            self.requests.add(task)
        try:
            return await handler(request)
        finally:
            if task is not None:
                self.requests.discard(task)
            if guarded is not None:
                guarded.request_ended()

    def stop_taking_requests(self) -> None:
        """Close idle connections now, and the busy ones once their request is done."""
        for connection in list(self.connections):
            connection.close_when_idle()

    async def finish_requests(self, grace_s: float, cut_wait_s: float) -> int:
        """Let the requests being handled run for up to `grace_s`, then cancel the rest and give
        them `cut_wait_s` to end (each writes its record as it ends). Returns how many were cut."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.requests and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(self.requests), timeout=left)
        late = set(self.requests)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=cut_wait_s)
        return len(late)


LISTENER = web.AppKey("slotwise_listener", Listener)


class GuardedConnection(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, and the timers around it. Until a request's
    head is in, the connection is closed after `header_timeout_s` (from its opening, or from the
    first byte after a response); between requests, after `keepalive_timeout_s` idle."""

    def __init__(self, listener: Listener, make: Callable[[], asyncio.Protocol]) -> None:
        self._listener = listener
        self._make = make
        self._inner: asyncio.Protocol | None = None  # None: refused
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False  # a request is being handled
        self._idle = False  # a response is done and no byte of the next request has come

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        loop = asyncio.get_running_loop()
        if not self._listener.admit(self, loop.time()):
            transport.write(refusal(self._listener.limits.max_connections))
            if transport.can_write_eof():
                transport.write_eof()
            self._arm(LINGER_S)
            return
        self._inner = self._make()
        self._inner.connection_made(transport)
        self._arm(self._listener.limits.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return  # refused: what it sends is dropped
        if self._idle:  # the next request's first bytes: its headers are timed from now
            self._idle = False
            self._arm(self._listener.limits.header_timeout_s)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._listener.connections.discard(self)
        self._transport = None
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    # -- told by the listener's middleware and its shutdown ------------------------------------------

    def request_started(self) -> None:
        self._busy, self._idle = True, False
        self._cancel_timer()

    def request_ended(self) -> None:
        self._busy, self._idle = False, True
        if self._transport is not None and not self._transport.is_closing():
            self._arm(self._listener.limits.keepalive_timeout_s)

    def close_when_idle(self) -> None:
        if not self._busy and self._transport is not None:
            self._transport.close()
        elif isinstance(self._inner, web.RequestHandler):
            self._inner.close()  # aiohttp's own: no further request on it, closed after this one

    # -- the one timer -----------------------------------------------------------------------------

    def _arm(self, delay: float) -> None:
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(delay, self._expire)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None or self._busy:
            return
        if transport.get_write_buffer_size():
            transport.abort()  # a client that does not read what it was sent
        else:
            transport.close()


def ensure_open_files(max_connections: int) -> str | None:
    """Raise this process's soft limit on open files to what `max_connections` needs (each client
    connection may hold an upstream one), within the hard limit; a warning if that is not enough."""
    need = 2 * max_connections + FILES_BESIDES_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target >= need:
        return None
    return (f"listen.max_connections = {max_connections} needs about {need} open files, but this "
            f"process may open only {target}: raise the limit (systemd LimitNOFILE=, ulimit -n) "
            "or lower listen.max_connections")


class ListenerSite(web.BaseSite):
    """A TCP site whose every connection passes the `Listener` first."""

    def __init__(self, runner: web.AppRunner, listener: Listener, host: str, port: int) -> None:
        super().__init__(runner, backlog=BACKLOG)
        self._listener = listener
        self._host, self._port = host, port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None, "the runner is not set up"
        self._server = await asyncio.get_running_loop().create_server(
            self._listener.protocol_factory(server), self._host, self._port,
            backlog=self._backlog)
