"""The facts of one request while it is in flight: one object, and one writer for each fact.

`Flight` is created by the handler at arrival and read once at the end to make the typed `Record`.
Every field says who sets it: the handler (at arrival and on its own errors), the intake (the body
and its rewrite), the registry (phase and the prefill's place on the time axis), the prefill gate
(`prefill`), the observer (what the upstream answered), the warmer (`warmed_tokens`, `warm_ids`),
the keeper of saved KV (`restored_tokens`, `kv_bytes`).
Nobody else writes it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from proxy.record.kind import Kind
from proxy.record.outcome import Outcome
from proxy.record.timing import RequestTimer


class Phase(enum.StrEnum):
    """Where a request is in its life, as the registry tracks it."""

    ARRIVED = "arrived"  # being read and estimated
    HELD = "held"  # held or being fed in pieces by the prefill policy
    QUEUED = "queued"  # sent upstream; no response headers yet (waiting in the server's queue)
    PREFILLING = "prefilling"  # the server is computing its prompt
    DECODING = "decoding"  # tokens are flowing
    WAITING = "waiting"  # non-streamed: sent, and nothing can be seen until the answer
    DONE = "done"


class PrefillPlan(enum.StrEnum):
    """What the prefill policy did with a request before it went upstream."""

    NONE = "none"  # forwarded as it came, at once
    HELD = "held"  # held in slotwise for a while
    CHUNKED = "chunked"  # its prompt was fed to the server in pieces first
    TRIMMED = "trimmed"  # a trim piece first: its prompt's last micro-batch computed as one tile


@dataclass
class PrefillFacts:
    """What the prefill gate did with one request. Written by the gate only, as it happens, so a
    request whose client leaves while held or fed still has them."""

    plan: PrefillPlan = PrefillPlan.NONE
    held_ms: float = 0.0
    slot_wait_ms: float = 0.0
    """Of `held_ms`, the time every slot of llama-server was in use or claimed for a restore."""
    pieces: int = 0
    fed_tokens: int = 0
    """Prompt tokens the server computed ahead of the request, in pieces."""
    est_prompt_tokens: int | None = None
    est_new_tokens: int | None = None
    note: str | None = None
    """Why the policy released it, or why it did not apply (fail open)."""


@dataclass(eq=False)
class Flight:
    """One request in flight: every observation slotwise makes of it."""

    # -- the handler, at arrival ------------------------------------------------------------------
    id: str
    kind: Kind
    method: str
    endpoint: str
    wall_start: float
    """time.time() at arrival (the record's `start`)."""
    config_gen: int
    timer: RequestTimer
    client: str | None = None
    """X-Slotwise-Client; the intake falls back to the body's `user`, then X-User-Id, X-Session-Id."""
    purpose: str | None = None
    node: str | None = None
    """The name of the node that served it (`cluster.node`, else HOSTNAME:PORT)."""

    # -- the intake: the body and its rewrite -------------------------------------------------------
    stream: bool = False
    bytes_in: int = 0
    lora_in: Any = None
    lora_out: Any = None
    lora_rewritten: bool = False
    progress_added: bool = False

    # -- the registry -----------------------------------------------------------------------------------
    phase: Phase = Phase.ARRIVED
    inflight_at_start: list[str] = field(default_factory=list)
    prefill_start: float | None = None
    prefill_end: float | None = None
    prefill_peers: list[PrefillSpan] = field(default_factory=list)
    """The prefills of others that overlapped this one's life (values, never the others)."""

    # -- the prefill gate -------------------------------------------------------------------------------
    prefill: PrefillFacts = field(default_factory=PrefillFacts)

    # -- the observer: what the upstream answered (the handler for slotwise's own errors) -----------
    status: int | None = None
    outcome: Outcome = Outcome.DONE
    error: str | None = None
    bytes_out: int = 0
    timings: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    computed_tokens: int | None = None
    """Prompt tokens the server computed for the request itself (progress, then timings)."""
    prefill_done_tokens: int | None = None
    """The latest progress chunk's `processed` (the status page)."""
    decoded: int = 0

    # -- the warm-ups (proxy/warm, the prefill gate's `warm` hook) ------------------------------------
    warmed_tokens: int = 0
    """Prompt tokens of this request that warm-ups computed ahead of it."""
    warm_ids: list[str] = field(default_factory=list)
    """The warm-ups that computed them."""

    # -- keep_kv (proxy/keep, the prefill gate's `keep` hook; the keeper's own save/restore records) --
    restored_tokens: int = 0
    """Prompt tokens of this request restored from a file slotwise saved, just before it was sent."""
    kv_file: str | None = None
    """A `kv_save`/`kv_restore` record's file name."""
    kv_tokens: int | None = None
    """The tokens that file holds (saved, or read back by a restore)."""
    kv_bytes: int = 0
    """Its size (written or read)."""

    def prefilling(self) -> bool:
        """Its prompt is being computed now: by the server, or (chunk mode) in pieces fed ahead."""
        return self.prefill_start is not None and self.prefill_end is None

    def all_computed_tokens(self) -> int | None:
        """Every prompt token the server computed for it: its own and its pieces'."""
        fed = self.prefill.fed_tokens
        if self.computed_tokens is None:
            return fed or None
        return self.computed_tokens + fed


class PrefillSpan:
    """One request's prefill as the records of the others in flight see it: its id, start, end
    and computed tokens. While the request is in flight they are read from its `Flight`; when it
    ends the registry closes the span, which keeps the figures and lets the `Flight` go, so a long
    request never keeps the requests that prefilled during its life in memory."""

    __slots__ = ("_end", "_flight", "_start", "_tokens", "id")

    def __init__(self, flight: Flight) -> None:
        self.id = flight.id
        self._flight: Flight | None = flight
        self._start: float | None = None
        self._end: float | None = None
        self._tokens: int | None = None

    def close(self) -> None:
        """The request has ended: keep its figures as they are now."""
        if (flight := self._flight) is not None:
            self._start, self._end = flight.prefill_start, flight.prefill_end
            self._tokens = flight.all_computed_tokens()
            self._flight = None

    @property
    def start(self) -> float | None:
        return self._flight.prefill_start if self._flight is not None else self._start

    @property
    def end(self) -> float | None:
        return self._flight.prefill_end if self._flight is not None else self._end

    @property
    def computed_tokens(self) -> int | None:
        """Every prompt token the server computed for it: its own and its pieces'."""
        return self._flight.all_computed_tokens() if self._flight is not None else self._tokens
