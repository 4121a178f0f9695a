"""The one wrapper that guarantees a trip through slotwise its answer and its one record, as uvicorn's
`run_asgi` does for a request: whatever the trip raises becomes slotwise's own error (or the cut of a
shutdown), and the trip's `finish` runs whatever happened. The catch-all handler's `Exchange` and the
warm endpoints' POST are trips.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from aiohttp import web

from proxy.record.flight import Flight
from proxy.record.outcome import Outcome
from proxy.request.errors import BadRequest, ProxyError, ShuttingDown, error_response
from proxy.state import ProxyState

log = logging.getLogger("slotwise.proxy")


class Trip(Protocol):
    flight: Flight
    response: web.StreamResponse | None
    """The answer once it is under way (its head sent or about to be), else None."""

    async def run(self) -> web.StreamResponse:
        """The trip's work, up to its answer; raises what stops it."""

    def fail(self, error: ProxyError) -> web.StreamResponse:
        """Answer with slotwise's own error (if the client has had no answer yet)."""

    def can_answer(self) -> bool:
        """Whether the client can still be told why the trip ends."""

    async def cut(self, error: ShuttingDown) -> web.StreamResponse:
        """End the trip that shutdown cut (`can_answer`), telling the client `error`."""

    def finish(self) -> None:
        """Close what is open and write the trip's one record; never raises."""


async def guaranteed(trip: Trip, state: ProxyState) -> web.StreamResponse:
    """Run `trip` and answer it whatever happens; its `finish` runs last, always."""
    try:
        return await trip.run()
    except ProxyError as exc:
        return trip.fail(exc)
    except web.RequestPayloadError as exc:  # e.g. a Content-Encoding its bytes do not follow
        reason = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["broken"]
        return trip.fail(BadRequest(f"the request body could not be read: {reason[-1]}"))
    except ConnectionResetError:
        trip.flight.outcome = Outcome.CLIENT_GONE
        return trip.response or web.Response(status=499)
    except asyncio.CancelledError:
        trip.flight.outcome = Outcome.SHUTDOWN if state.stopping else Outcome.CLIENT_GONE
        if not (state.stopping and trip.can_answer()):
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()  # it ends now, answered
        return await trip.cut(ShuttingDown(
            "slotwise is stopping and its shutdown grace period is over (listen.shutdown_grace_s); "
            "send the request again"))
    except Exception as exc:
        log.exception("request %s failed inside slotwise", trip.flight.id)
        return trip.fail(ProxyError(f"internal error: {type(exc).__name__}: {exc}"))
    finally:
        trip.finish()


def failed(flight: Flight, error: ProxyError) -> web.Response:
    """The answer with slotwise's own error, its facts written on the trip's `flight`."""
    flight.outcome, flight.error, flight.status = error.outcome, error.message, error.status
    flight.bytes_out = len(error.body_bytes())
    return error_response(error, flight.id)
