"""Turns what the upstream answers into facts about one request: the response headers, every stream
event, a whole body, and the end.

Synchronous and free of I/O: each method takes the time as a number, writes the `Flight`'s upstream
facts and moves it through the registry's phases. The relay calls it as bytes pass; tests call it
with plain values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from proxy.record.flight import Flight, Phase
from proxy.record.inflight import Registry
from proxy.record.outcome import Outcome
from proxy.request.endpoints import GENERATING
from proxy.request.errors import BadUpstreamStream
from proxy.request.signals import Signal, What, interpret
from proxy.request.sse import SseEvent
from proxy.request.usage import prompt_counts

Clock = Callable[[], float]


class Observer:
    """The observations of one request's response."""

    def __init__(self, flight: Flight, registry: Registry, *, drop_progress: bool) -> None:
        self.flight = flight
        self.registry = registry
        self.drop_progress = drop_progress
        """slotwise asked for `prompt_progress` itself: those events are not the client's."""

    def sent(self, now: float) -> None:
        """The request goes upstream: a stream waits in the server's queue, a plain one waits."""
        self.flight.timer.on_sent(now)
        self.registry.move(self.flight, Phase.QUEUED if self.flight.stream else Phase.WAITING, now)

    def headers(self, status: int, content_type: str, now: float) -> bool:
        """The response headers came; True if the response is an event stream. For a stream of a
        generating endpoint llama-server sends them when the slot starts the prefill."""
        self.flight.status = status
        is_sse = content_type == "text/event-stream"
        prefill_starts = is_sse and status == 200 and self.flight.kind in GENERATING
        self.flight.timer.on_headers(now, prefill_starts=prefill_starts)
        if prefill_starts:
            self.registry.move(self.flight, Phase.PREFILLING, now)
        return is_sse

    def event(self, event: SseEvent, now: float) -> bool:
        """One stream event; True if the client should see it."""
        signal = interpret(self.flight.kind, event)
        self._signal(signal, now)
        return not (self.drop_progress and signal.what is What.PROGRESS)

    def wrote(self, size: int) -> None:
        self.flight.bytes_out += size

    def broke(self, outcome: Outcome, message: str) -> None:
        """The response could not be relayed to its end (the upstream broke off or went silent)."""
        self.flight.outcome, self.flight.error = outcome, message

    def body(self, data: bytes | None) -> None:
        """A whole non-streamed body (None: too large to parse), then the request's end."""
        if data is not None:
            self._body(data)
        self._place_unseen_prefill()

    def ended(self) -> None:
        """The response was relayed (or cut): an error status is the upstream's error."""
        flight = self.flight
        if flight.status is not None and flight.status >= 400 and flight.outcome is Outcome.DONE:
            flight.outcome = Outcome.UPSTREAM_ERROR

    # ---- stream events -----------------------------------------------------------------------

    def _signal(self, signal: Signal, now: float) -> None:
        flight = self.flight
        what = signal.what
        if what is What.TOKEN:
            flight.timer.on_token(now)
            flight.decoded += 1
            if flight.decoded == 1:
                self.registry.move(flight, Phase.DECODING, now)
        elif what is What.PROGRESS and signal.progress is not None:
            self._progress(signal.progress, now)
        elif what is What.ERROR:
            flight.outcome, flight.error = Outcome.UPSTREAM_ERROR, signal.error
        elif what is What.MALFORMED:
            raise BadUpstreamStream(f"the upstream sent a malformed event: {signal.error}")
        if signal.timings is not None:
            self._timings(signal.timings)
        if signal.prompt_tokens is not None:
            flight.prompt_tokens = signal.prompt_tokens
        if signal.computed_tokens is not None and flight.timings is None:  # timings rule if given
            flight.computed_tokens = signal.computed_tokens

    def _progress(self, progress: dict[str, Any], now: float) -> None:
        flight = self.flight
        first = not flight.timer.progress_seen
        flight.timer.on_progress(now, progress)
        total, cache = progress.get("total"), progress.get("cache")
        processed = progress.get("processed")
        if isinstance(processed, int):
            flight.prefill_done_tokens = processed
        if first and isinstance(total, int) and isinstance(cache, int):
            flight.prompt_tokens = total
            flight.computed_tokens = total - cache

    def _timings(self, timings: dict[str, Any]) -> None:
        flight = self.flight
        flight.timings = timings
        prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
        if isinstance(prompt_n, int):
            flight.computed_tokens = prompt_n
            if isinstance(cache_n, int):
                flight.prompt_tokens = prompt_n + cache_n

    # ---- a whole body --------------------------------------------------------------------------

    def _body(self, data: bytes) -> None:
        flight = self.flight
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        if flight.status is not None and flight.status >= 400:
            error = obj.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            flight.error = str(message or obj)[:500]
            return
        timings = obj.get("timings")
        if isinstance(timings, dict):
            self._timings(timings)
        total, computed = prompt_counts(flight.kind, obj)
        if total is not None:
            flight.prompt_tokens = total
        if computed is not None and not isinstance(timings, dict):
            flight.computed_tokens = computed

    def _place_unseen_prefill(self) -> None:
        """A non-streamed answer shows its prefill only in its totals: put it on the time axis
        afterwards (it ended `predicted_ms` before the answer and lasted `prompt_ms`), so the
        requests still in flight see it in their records' overlaps."""
        flight = self.flight
        timings, answered = flight.timings, flight.timer.headers
        if flight.kind not in GENERATING or timings is None or answered is None:
            return
        prompt_ms, predicted_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
        if not isinstance(prompt_ms, int | float) or not isinstance(predicted_ms, int | float):
            return
        ended = answered - predicted_ms / 1000.0
        self.registry.place_prefill(flight, ended - prompt_ms / 1000.0, ended)
