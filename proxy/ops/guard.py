"""The guard on slotwise's own pages (/metrics, /slotwise/, /slotwise/status): each handler is
wrapped so that `access.decide_page` is asked first, with the config in force, and a refusal is
answered as slotwise's own error. The feature also says, at start and after each reload, what
slotwise leaves open to anyone when it listens beyond loopback.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from proxy.config import Config
from proxy.request.access import Refuse, decide_page, exposure
from proxy.request.errors import error_response
from proxy.state import STATE

log = logging.getLogger("slotwise")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guarded(handler: Handler) -> Handler:
    """`handler`, served only to whom `[access]` lets see the pages."""

    @functools.wraps(handler)
    async def guard(request: web.Request) -> web.StreamResponse:
        verdict = decide_page(request.app[STATE].config, request.path, request.headers)
        if isinstance(verdict, Refuse):
            return error_response(verdict.error())
        return await handler(request)

    return guard


def warn_exposure(config: Config) -> None:
    """Log, as one warning, what anyone who can reach slotwise may do without a key."""
    line = exposure(config)
    if line is not None:
        log.warning("%s", line)


def install(app: web.Application) -> None:
    """The feature: the exposure warning at start and after each reload (the pages wrap their
    own handlers with `guarded`)."""

    async def guard_ctx(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        warn_exposure(state.config)
        state.reload_hooks.append(warn_exposure)
        yield

    app.cleanup_ctx.append(guard_ctx)
