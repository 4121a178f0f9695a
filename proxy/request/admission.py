"""The contract between the handler and whatever decides when a request may go upstream.

The handler awaits `gate.admit(flight, body)` before forwarding; the gate may return at once, hold
the request, or feed its prompt in pieces first, and writes what it did on `flight.prefill` as it
happens. A client that leaves cancels the await, and the gate must then forget the request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from proxy.record.flight import Flight

if TYPE_CHECKING:
    from proxy.prefill.snapshot import PolicySnapshot


class Gate(Protocol):
    async def admit(self, flight: Flight, body: dict[str, Any]) -> None:
        """Return when the request may be forwarded; raise `Rejected` to turn it away."""
        ...

    def snapshot(self) -> PolicySnapshot | None:
        """The policy's state for the status page and `/metrics` (None: no policy)."""
        ...


class OpenGate:
    """Admits everything at once: the `off` policy."""

    async def admit(self, flight: Flight, body: dict[str, Any]) -> None:
        return None

    def snapshot(self) -> PolicySnapshot | None:
        return None
