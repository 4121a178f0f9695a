"""Builds the aiohttp application and runs it: one upstream session for the whole process, owned by
a cleanup context; the catch-all route last, after slotwise's own pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

from proxy.allocator import return_large_buffers
from proxy.cluster.feature import install as install_cluster
from proxy.config import Config
from proxy.connector import UpstreamConnector
from proxy.keep.feature import install as install_keep
from proxy.listener import CUT_WAIT_S, LISTENER, Listener, ListenerSite, ensure_open_files
from proxy.ops import guard, lifecycle, metrics, status
from proxy.ops.lora_watch import install as install_lora
from proxy.record.timing_log import TimingLog
from proxy.request.handler import handle
from proxy.request.headers import REQUEST_ID_HEADER, client_request_id
from proxy.request.rejected import ParserErrors
from proxy.scheduler import install as install_scheduler
from proxy.state import STATE, ProxyState
from proxy.warm.feature import install as install_warm

log = logging.getLogger("slotwise")


UPSTREAM_IDLE_KEEP_S = 4.0
"""llama-server closes a kept-alive connection after 5 s idle (`Keep-Alive: timeout=5`); one
reused just then dies under the request (`upstream.send` retries it), so idle ones go sooner."""


def upstream_session(config: Config) -> aiohttp.ClientSession:
    """The one client session: pooled connections, no total timeout (a generation may run long),
    bytes passed on exactly as the upstream sent them."""
    timeout = aiohttp.ClientTimeout(total=None, connect=config.upstream.connect_timeout_s,
                                    sock_read=config.upstream.read_timeout_s)
    connector = UpstreamConnector(limit=0, ttl_dns_cache=300,
                                  keepalive_timeout=UPSTREAM_IDLE_KEEP_S)
    return aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False,
                                 skip_auto_headers=("User-Agent", "Content-Type"))


async def say_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """An answer slotwise makes itself (/health, /get_load, its pages and errors) says the client's
    `X-Request-Id`, made a safe token, or a new id, as a forwarded answer does; they write no
    record, so the id is not made unique. Forwarded answers say their record's id already."""
    if REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = client_request_id(request.headers) or uuid.uuid4().hex[:16]


REFUSAL_SUMMARIES_EVERY_S = 5.0
"""How often the summaries of refused requests whose minute is over are written."""


async def emit_refusal_summaries(state: ProxyState) -> None:
    while True:
        await asyncio.sleep(REFUSAL_SUMMARIES_EVERY_S)
        try:
            state.emit_summaries()
        except Exception:  # the next round tries again; the log says why
            log.exception("writing the summaries of refused requests failed")


# Each feature installs itself on the application: its routes, and a cleanup context that runs
# after the core one below (so `app[STATE]` exists). Order matters only for routes.
Feature = Callable[[web.Application], None]
FEATURES: tuple[Feature, ...] = (lifecycle.install, guard.install, metrics.install, status.install,
                                 install_lora, install_scheduler, install_warm, install_keep,
                                 install_cluster)


def create_app(config: Config, *, clock: Callable[[], float] = time.monotonic) -> web.Application:
    app = web.Application(client_max_size=int(config.listen.max_body_mb * 1024 * 1024) + 1)
    listener = app[LISTENER] = Listener(config.listen)
    app.middlewares.append(listener.middleware)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        timing_log = TimingLog.open(config.log.timing)  # first: its config error leaves nothing open
        session = upstream_session(config)
        state = ProxyState(config=config, timing_log=timing_log, session=session, clock=clock)
        app[STATE] = state
        state.reload_hooks.append(lambda new: listener.apply(new.listen))
        summaries = asyncio.create_task(emit_refusal_summaries(state))
        try:
            yield
        finally:
            summaries.cancel()
            await session.close()
            state.emit_summaries(every=True)
            state.timing_log.close()

    app.cleanup_ctx.append(lifecycle)
    for install in FEATURES:
        install(app)
    app.router.add_route("*", "/{tail:.*}", handle)
    app.on_response_prepare.append(say_request_id)
    return app


async def start(config: Config) -> tuple[web.AppRunner, str]:
    """Start listening; return the runner (for cleanup) and the URL actually bound.

    Handlers are cancelled when their client disconnects: that is what closes the upstream
    request at once, so llama-server stops working for nobody.
    """
    app = create_app(config)
    # aiohttp's connection handler tells its `logger` of requests its HTTP parser rejects.
    # The grace period is the drain's (lifecycle.drain): aiohttp's own wait only closes what is left.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=ParserErrors(app),
                           shutdown_timeout=CUT_WAIT_S)
    if warning := ensure_open_files(config.listen.max_connections):
        log.warning("%s", warning)
    return_large_buffers()  # a large body's buffers go back to the system once freed
    try:
        await runner.setup()  # runs every feature's start; one may refuse the config
        site = ListenerSite(runner, app[LISTENER], config.listen.host, config.listen.port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, _bound_url(runner, config)


async def serve(config: Config, *, ready: Callable[[str], None] | None = None,
                config_path: str | None = None) -> None:
    """Run until SIGINT or SIGTERM, then let the streams in flight finish (up to
    `listen.shutdown_grace_s`); SIGHUP re-reads `config_path`."""
    runner, url = await start(config)
    runner.app[lifecycle.OPS].config_path = config_path
    log.info("slotwise listening on %s, upstream %s, timing log %s",
             url, config.upstream.url, config.log.timing)
    if ready is not None:
        ready(url)
    await lifecycle.run_until_stopped(runner)


def _bound_url(runner: web.AppRunner, config: Config) -> str:
    for address in runner.addresses:
        if isinstance(address, tuple):
            return f"http://{config.listen.host}:{address[1]}"
    return f"http://{config.listen.host}:{config.listen.port}"
