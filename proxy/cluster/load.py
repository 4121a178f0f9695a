"""The load figure a router reads from `GET /get_load`: what is ahead of a new request on this node,
counted from what only slotwise knows. Pure: it reads the in-flight `Flight`s as values.

A router counts the requests it sent itself and nothing else. slotwise also sees the requests that
reached the node another way (another router, a direct client), which of them wait (held or fed in
pieces by the prefill policy, queued in llama-server), and how many prompt tokens are still to be
computed. The figure, in requests:

1. every generating request in flight counts 1;
2. every one of them that waits (held by the prefill policy, or queued in llama-server) 1 more:
   a new request would wait behind it;
3. every `prefill.cold_tokens` prompt tokens still to compute (estimated; as the progress chunks
   count them down once the prefill runs) 1 more, rounded up: a cold prompt weighs as much as the
   requests it will delay.

Only requests slotwise estimated have cold tokens (prefill modes `defer` and `chunk`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proxy.record.flight import Flight, Phase
from proxy.request.endpoints import GENERATING

WAITING_PHASES = (Phase.HELD, Phase.QUEUED)
RUNNING_PHASES = (Phase.PREFILLING, Phase.DECODING, Phase.WAITING)


@dataclass(frozen=True)
class NodeLoad:
    arriving: int = 0
    """Being read or estimated."""
    held: int = 0
    """Held, or fed in pieces, by the prefill policy."""
    queued: int = 0
    """Sent to llama-server, waiting in its queue (no response headers yet)."""
    running: int = 0
    """In a slot: prefilling, decoding, or (not streamed) waiting for the whole answer."""
    cold_tokens: int = 0
    """Prompt tokens estimated still to compute for the requests in flight."""
    unit_tokens: int = 2000
    """Prompt tokens that count as one request (`prefill.cold_tokens`)."""

    @property
    def requests(self) -> int:
        return self.arriving + self.held + self.queued + self.running

    @property
    def waiting(self) -> int:
        return self.held + self.queued

    @property
    def load(self) -> int:
        return self.requests + self.waiting + math.ceil(self.cold_tokens / max(1, self.unit_tokens))


def pending_tokens(flight: Flight) -> int:
    """Prompt tokens of `flight` still to compute: its estimate less the pieces fed, or once its
    prefill runs, what the progress chunks have not counted yet."""
    if flight.phase is Phase.PREFILLING and flight.prompt_tokens is not None \
            and flight.prefill_done_tokens is not None:
        return max(0, flight.prompt_tokens - flight.prefill_done_tokens)
    if flight.phase in (Phase.ARRIVED, Phase.HELD, Phase.QUEUED, Phase.PREFILLING):
        estimated = flight.prefill.est_new_tokens
        return max(0, estimated - flight.prefill.fed_tokens) if estimated is not None else 0
    return 0


def node_load(flights: Iterable[Flight], unit_tokens: int) -> NodeLoad:
    """The load of the generating requests among `flights` (the registry's live requests)."""
    counts = {"arriving": 0, "held": 0, "queued": 0, "running": 0}
    cold = 0
    for flight in flights:
        if flight.kind not in GENERATING or flight.phase is Phase.DONE:
            continue
        phase = flight.phase
        slot = ("held" if phase is Phase.HELD else "queued" if phase is Phase.QUEUED
                else "running" if phase in RUNNING_PHASES else "arriving")
        counts[slot] += 1
        cold += pending_tokens(flight)
    return NodeLoad(**counts, cold_tokens=cold, unit_tokens=unit_tokens)


def vllm_body(load: NodeLoad, node: str) -> dict[str, Any]:
    """vllm-router's format: it reads `load` (an integer); the rest is for people."""
    return {"load": load.load, "node": node, "requests": load.requests, "waiting": load.waiting,
            "held": load.held, "queued": load.queued, "running": load.running,
            "arriving": load.arriving, "cold_tokens": load.cold_tokens}


def sglang_body(load: NodeLoad) -> list[dict[str, Any]]:
    """sglang-router's format: one entry per data-parallel rank (slotwise is one); it sums
    `num_tokens`, here the same figure in tokens (load × `prefill.cold_tokens`)."""
    return [{"dp_rank": 0, "num_reqs": load.requests, "num_waiting_reqs": load.waiting,
             "num_tokens": load.load * load.unit_tokens}]
