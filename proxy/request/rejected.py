"""Requests aiohttp's HTTP parser rejects before slotwise's handler runs (a malformed request line or
header, an unknown method, a line too long): aiohttp answers 400 itself and reports the error to its
connection handler's `logger`. `ParserErrors` is that logger.

Each rejected request leaves one WARNING line without a traceback (at most `LogLimit` lines a
minute, so no client can flood the log) and one timing record with outcome `bad_request`. Every
other error aiohttp reports keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError

from proxy.record.clientstrings import safe_text
from proxy.record.kind import Kind
from proxy.record.log_limit import LogLimit
from proxy.record.outcome import Outcome
from proxy.record.schema import Record
from proxy.state import STATE

log = logging.getLogger("slotwise.proxy")


class ParserErrors(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's `aiohttp.server` logger, but a request its parser rejected is told once, briefly."""

    def __init__(self, app: web.Application, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.app = app
        self.clock = clock
        self.limit = LogLimit()

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = _exception(exc_info)
        if isinstance(exc, HttpProcessingError):
            self.rejected(args[0] if args else None, exc)
        elif isinstance(exc, web.RequestPayloadError):
            # the rest of a body slotwise already answered 400 (its record says why) is unreadable
            self.told(f"the rest of a request body could not be read: {_last_line(exc)}")
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        # aiohttp tells a bad method on a connection's first request at debug level only (TLS or
        # other traffic that is not HTTP); it is answered 400 all the same, so it is recorded too.
        exc = _exception(kwargs.get("exc_info"))
        if isinstance(exc, BadHttpMethod):
            self.rejected(args[0] if args else None, exc)
        else:
            super().debug(msg, *args, **kwargs)

    def rejected(self, peer: object, exc: HttpProcessingError) -> None:
        """One rejected request: its line (if the limit allows) and its record."""
        reason = safe_text(_first_line(exc), 200)
        self.told(f"answered 400 to a request from {peer} that is not valid HTTP: {reason}")
        state = self.app.get(STATE)
        if state is None:  # not serving yet, or any more
            return
        record = Record(
            id=state.ids.issue(None, lambda taken: state.registry.get(taken) is not None),
            start=datetime.now(UTC).isoformat(timespec="milliseconds"), kind=Kind.OTHER, status=400,
            outcome=Outcome.BAD_REQUEST, error=f"not valid HTTP: {reason}", config_gen=state.config_gen)
        state.emit(record, peer=peer if isinstance(peer, str) else None, sample=True)


    def told(self, line: str) -> None:
        """One WARNING line, if the limit allows it now."""
        allowed, left_out = self.limit.allow(self.clock())
        if allowed:
            more = f" ({left_out} more since the last line)" if left_out else ""
            log.warning("%s%s", line, more)


def _exception(exc_info: Any) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if exc_info is True:
        return sys.exc_info()[1]
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        found = exc_info[1]
        return found if isinstance(found, BaseException) else None
    return None


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return safe_text(lines[-1], 200) or ""


def _first_line(exc: HttpProcessingError) -> str:
    """The parser's reason, without the excerpt of the request's bytes aiohttp appends to it (it may
    hold a header's value: a key, a cookie)."""
    message = exc.message if isinstance(exc.message, str) else ""
    first = message.strip().splitlines()[0].rstrip(":") if message.strip() else ""
    return first or type(exc).__name__
