"""The contract between the handler and whatever decides when a request may go upstream.

The handler awaits `gate.admit(flight, body)` before forwarding; the gate may return at once, hold
the request, or feed its prompt in pieces first, and writes what it did on `flight.prefill` as it
happens. A client that leaves cancels the await, and the gate must then forget the request.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from proxy.record.flight import Flight


class Gate(Protocol):
    async def admit(self, flight: Flight, body: dict[str, Any]) -> None:
        """Return when the request may be forwarded; raise `Rejected` to turn it away."""
        ...


ADMISSION = web.AppKey("slotwise_admission", Gate)
"""The gate the handler awaits, which the scheduler publishes when the app starts
(proxy/scheduler.py)."""
