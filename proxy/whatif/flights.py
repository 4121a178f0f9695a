"""The records a replay writes, made the way slotwise makes them: each request's `Flight` moved
through the real `Registry` (who is in flight, whose prefill overlapped whom) at the simulated
times, as the observer moves it for what the server sends, and `build_record` at its end; kept KV's
restores and saves by the keeper's own `kv_flight`, warm-ups by the warmer's `warm_record`. So a
what-if's log has every field of the record, in its format, computed by the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.keep.record import kv_flight, kv_record
from proxy.record.flight import Flight, Phase
from proxy.record.inflight import Registry
from proxy.record.kind import Kind
from proxy.record.outcome import Outcome
from proxy.record.schema import Record, build_record
from proxy.record.timing import RequestTimer
from proxy.report.records import num
from proxy.request.errors import ProxyError
from proxy.warm.record import ended_warm_record, warm_record
from proxy.warm.values import WarmUp
from proxy.whatif.requests import Job
from proxy.whatif.slots import Task


class Witness:
    def __init__(self, *, build: bool = True) -> None:
        self.registry = Registry()
        self.records: list[Record] = []
        self._build = build
        """False: no records are made (a replay that only wants the server's figures)."""

    def arrive(self, job: Job, now: float, lora_out: Any, rewritten: bool) -> Flight:
        rec = job.record
        flight = Flight(
            id=job.id, kind=Kind(str(rec.get("kind"))), method=str(rec.get("method") or "POST"),
            endpoint=str(rec.get("endpoint") or ""), wall_start=now,
            config_gen=int(num(rec, "config_gen") or 1), timer=RequestTimer(arrived=now),
            client=job.client, purpose=text_or_none(rec.get("purpose")),
            node=text_or_none(rec.get("node")))
        flight.stream, flight.bytes_in = job.stream, int(num(rec, "bytes_in") or 0)
        flight.lora_in, flight.lora_out, flight.lora_rewritten = job.lora_in, lora_out, rewritten
        flight.progress_added = rec.get("progress_added") is True
        self.registry.add(flight, now)
        return flight

    def hold(self, flight: Flight, now: float) -> None:
        self.registry.move(flight, Phase.HELD, now)

    def piece_started(self, flight: Flight, now: float) -> None:
        self.registry.start_prefill(flight, now)

    def sent(self, flight: Flight, now: float) -> None:
        flight.timer.on_sent(now)
        self.registry.move(flight, Phase.QUEUED if flight.stream else Phase.WAITING, now)

    def started(self, flight: Flight, task: Task, now: float) -> None:
        """The slot starts the prompt: a stream's headers (and first progress chunk) come now."""
        if not flight.stream:
            return
        flight.status = 200
        flight.timer.on_headers(now, prefill_starts=True)
        flight.prompt_tokens, flight.computed_tokens = task.prompt.length, task.prompt_n
        self.registry.move(flight, Phase.PREFILLING, now)

    def first_token(self, flight: Flight, now: float) -> None:
        if flight.stream:
            flight.timer.on_token(now)
            flight.decoded = 1
            self.registry.move(flight, Phase.DECODING, now)

    def finished(self, flight: Flight, task: Task, events: int, now: float) -> None:
        flight.timings = timings(task)
        flight.prompt_tokens, flight.computed_tokens = task.prompt.length, task.prompt_n
        if flight.stream:
            flight.timer.tokens[1:] = pick(task.tokens, events)[1:]
        else:
            flight.status = 200
            flight.timer.on_headers(now, prefill_starts=False)
            if task.t_start is not None and task.tokens:
                self.registry.place_prefill(flight, task.t_start, task.tokens[0])
        self._end(flight, now)

    def failed(self, flight: Flight, status: int, error: str, now: float) -> None:
        if flight.status is None:
            flight.status = status
        flight.outcome, flight.error = Outcome.UPSTREAM_ERROR, error
        self._end(flight, now)

    def gone(self, flight: Flight, task: Task | None, events: int, now: float) -> None:
        """The client left at `now`: what it had seen by then."""
        flight.outcome = Outcome.CLIENT_GONE
        if flight.stream and task is not None and task.tokens:
            seen = [t for t in task.tokens if t <= now]
            flight.timer.tokens[1:] = pick(seen, events * len(seen) // max(1, len(task.tokens)))[1:]
        self._end(flight, now)

    def rejected(self, flight: Flight, reason: str, now: float) -> None:
        flight.status, flight.outcome = 503, Outcome.REJECTED
        flight.error = f"slotwise is holding too many cold prompts: {reason}"
        self._end(flight, now)

    def kv_call(self, call_id: str, slot: int, kind: Kind, file: str | None, *, start: float,
                end: float, client: str | None, tokens: int | None, restored: int) -> None:
        """A restore or a save of kept KV, recorded as slotwise's keeper records it."""
        if not self._build:
            return
        flight = kv_flight(call_id, slot, kind, file or "", now=start, wall=start, config_gen=1,
                           client=client)
        flight.status, flight.outcome = 200, Outcome.DONE
        flight.kv_tokens, flight.restored_tokens = tokens, restored
        self.records.append(kv_record(flight, end))

    def warm_ended(self, flight: Flight, warm: WarmUp, now: float) -> None:
        """A warm-up's one record, as the warmer writes it when it ends."""
        record = ended_warm_record(flight, warm, self.registry, now)
        if self._build:
            self.records.append(record)

    def warm_refused(self, flight: Flight, error: ProxyError, now: float) -> None:
        """A refused warm-up call's record, as the warm-up route writes it (`request/trip.py`)."""
        flight.outcome, flight.error, flight.status = error.outcome, error.message, error.status
        flight.timer.on_end(now)
        if self._build:
            self.records.append(warm_record(flight, None))

    def _end(self, flight: Flight, now: float) -> None:
        flight.timer.on_end(now)
        self.registry.finish(flight, now)
        if self._build:
            self.records.append(build_record(flight))


def timings(task: Task) -> dict[str, Any]:
    """The server's `timings` object for a finished task, as llama-server computes it."""
    first = task.tokens[0] if task.tokens else None
    prompt_ms = task.prompt_ms
    predicted_ms = (task.tokens[-1] - first) * 1000.0 if first is not None else 0.0
    steps = max(1, task.n_gen - 1)
    return {
        "cache_n": task.cache_n,
        "prompt_n": task.prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / max(1, task.prompt_n), 3),
        "prompt_per_second": round(task.prompt_n / prompt_ms * 1000.0, 3) if prompt_ms else 0.0,
        "predicted_n": task.n_gen,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / steps, 3),
        "predicted_per_second": round(steps / predicted_ms * 1000.0, 3) if predicted_ms else 0.0,
    }


def pick(times: Sequence[float], events: int) -> list[float]:
    """`events` of the token times, spread evenly, the first and the last among them (a stream's
    event can carry several tokens: a multi-byte character, a chat parser's held-back diff)."""
    n = len(times)
    if events >= n or n <= 1:
        return list(times)
    if events <= 1:
        return [times[0]]
    return [times[round(i * (n - 1) / (events - 1))] for i in range(events)]


def text_or_none(value: object) -> str | None:
    """A logged field that should be a string, else None."""
    return value if isinstance(value, str) else None
