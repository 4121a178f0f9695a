"""The contract between the handlers and whatever decides when a request may go upstream.

The handler awaits `gate.admit(...)` before forwarding; the gate may return at once, hold the
request, or feed its prompt in pieces first, and says what it did in an `Admission`. A client that
leaves cancels the await, and the gate must then forget the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from proxy.endpoints import Kind
from proxy.inflight import Flight


@dataclass(frozen=True)
class Admission:
    plan: str = "none"  # none | held | chunked
    held_ms: float = 0.0
    pieces: int = 0
    est_prompt_tokens: int | None = None
    est_new_tokens: int | None = None
    note: str | None = None  # why a policy did not apply (fail open)


class Gate(Protocol):
    async def admit(self, flight: Flight, kind: Kind, body: dict[str, Any]) -> Admission:
        """Return when the request may be forwarded; raise `Rejected` to turn it away."""
        ...


class OpenGate:
    """Admits everything at once: the `off` policy."""

    async def admit(self, flight: Flight, kind: Kind, body: dict[str, Any]) -> Admission:
        return Admission()
