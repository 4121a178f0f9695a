"""The requests in flight now: each one's phase, and whose prefills overlapped whose life.

The handlers move a request through its phases; listeners (the prefill gate, the metrics) hear every
change. It is the one place that knows "who is generating now", and it is plain synchronous code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from proxy.record.flight import Flight, Phase, PrefillSpan

log = logging.getLogger("slotwise.inflight")


Listener = Callable[[Flight, Phase, Phase, float], None]


class Registry:
    def __init__(self) -> None:
        self._live: dict[str, Flight] = {}
        self._spans: dict[Flight, PrefillSpan] = {}  # the live requests' prefills, once started
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def __iter__(self) -> Iterator[Flight]:
        return iter(list(self._live.values()))

    def __len__(self) -> int:
        return len(self._live)

    def get(self, request_id: str) -> Flight | None:
        return self._live.get(request_id)

    def add(self, flight: Flight, now: float) -> None:
        flight.inflight_at_start = list(self._live)
        flight.prefill_peers = [self._span(f) for f in self._live.values() if f.prefilling()]
        self._live[flight.id] = flight
        self._notify(flight, Phase.DONE, flight.phase, now)

    def move(self, flight: Flight, phase: Phase, now: float) -> None:
        old = flight.phase
        if old is phase or old is Phase.DONE:
            return
        flight.phase = phase
        if phase is Phase.PREFILLING:
            self.start_prefill(flight, now)
        if (old is Phase.PREFILLING or phase is Phase.DONE) and flight.prefill_end is None \
                and flight.prefill_start is not None:
            flight.prefill_end = now
        self._notify(flight, old, phase, now)

    def start_prefill(self, flight: Flight, now: float) -> None:
        """The server starts computing this request's prompt (or, in chunk mode, its first piece):
        every other request in flight will see this prefill in its record's overlaps."""
        if flight.prefill_start is not None:
            return
        flight.prefill_start = now
        if flight.phase is Phase.DONE:  # a piece that started as its request ended
            span = PrefillSpan(flight)
            span.close()
        else:
            span = self._span(flight)
        for other in self._live.values():
            if other is not flight:
                other.prefill_peers.append(span)

    def place_prefill(self, flight: Flight, start: float, end: float) -> None:
        """A prefill seen only afterwards (a non-streamed answer's totals) put on the time axis."""
        self.start_prefill(flight, start)
        flight.prefill_end = end

    def finish(self, flight: Flight, now: float) -> None:
        self.move(flight, Phase.DONE, now)
        self._live.pop(flight.id, None)
        if (span := self._spans.pop(flight, None)) is not None:
            span.close()  # the others' records keep its figures, not the request

    def _span(self, flight: Flight) -> PrefillSpan:
        """The live request's prefill as the others' records see it (made once)."""
        span = self._spans.get(flight)
        if span is None:
            span = self._spans[flight] = PrefillSpan(flight)
        return span

    def _notify(self, flight: Flight, old: Phase, new: Phase, now: float) -> None:
        for listener in self._listeners:
            try:
                listener(flight, old, new, now)
            except Exception:  # one broken listener must not stop the others or the request
                log.exception("a listener failed on %s: %s -> %s", flight.id, old, new)

    def generating(self) -> list[Flight]:
        """Requests that are (or may be) producing tokens now."""
        return [f for f in self._live.values()
                if f.phase in (Phase.PREFILLING, Phase.DECODING, Phase.WAITING)]
