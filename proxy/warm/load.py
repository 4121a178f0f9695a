"""What the real requests are doing, as a warm-up sees it: the `Load` the queue decides by. Pure:
the prefill policy's held requests and the registry's flights in, a `Load` out.

A warm-up's own pieces are not flights: they never count here.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.prefill.server_use import SENT_GRACE_S
from proxy.record.flight import Flight, Phase
from proxy.request.endpoints import GENERATING
from proxy.warm.values import Load

UPSTREAM = (Phase.QUEUED, Phase.PREFILLING, Phase.DECODING, Phase.WAITING)
"""Phases of a request that is upstream (generating, or about to)."""


def current_load(held: Iterable[str], flights: Iterable[Flight], now: float) -> Load:
    """`held`: the cold requests the prefill policy holds or feeds (its snapshot's `held`).

    A request sent but not seen prefilling yet (a stream waits for its slot; a non-streamed one
    shows nothing until it ends) counts as prefilling for the policy's SENT_GRACE_S after it was
    sent, so that a piece does not start just as its prompt does."""
    cold_held = any(True for _ in held)
    prefilling, busy, decoders = False, False, 0
    recheck: float | None = None
    for flight in flights:
        if flight.kind not in GENERATING:
            continue
        phase = flight.phase
        cold_held = cold_held or phase is Phase.HELD
        busy = busy or phase in UPSTREAM
        decoders += phase is Phase.DECODING
        if phase is Phase.PREFILLING:
            prefilling = True
        elif phase in (Phase.QUEUED, Phase.WAITING):
            sent = flight.timer.sent if flight.timer.sent is not None else now
            grace_end = sent + SENT_GRACE_S
            if now < grace_end:
                prefilling = True
                recheck = grace_end if recheck is None else min(recheck, grace_end)
    return Load(cold_held=cold_held, prefilling=prefilling, busy=busy, decoders=decoders,
                recheck_at=recheck)
