"""The live status page at /slotwise/ and its JSON at /slotwise/status: what each request in flight
is doing now, what llama-server's slots are doing, the last minutes of time-to-first-token and stall
figures, and the config in force. The page (status_page.html, self-contained) polls the JSON.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from aiohttp import web

from proxy.config import config_to_dict
from proxy.ops.guard import guarded
from proxy.ops.lifecycle import OPS, Operations
from proxy.record.flight import Flight, Phase
from proxy.record.schema import Record
from proxy.record.timing import percentile
from proxy.request.endpoints import GENERATING
from proxy.state import STATE, ProxyState
from proxy.upstream import UpstreamCallError

RECENT_S = 300.0  # the "last minutes" the page summarises
RECENT_MAX = 5000  # records kept at most, whatever the rate
RATE_WINDOW_S = 3.0  # a decoding request's current rate: events over this window
SLOTS_EVERY_S = 1.0  # llama-server's /slots is polled at most this often, only while asked
SLOTS_TIMEOUT_S = 2.0


@dataclass
class SlotsView:
    """The latest answer of llama-server's GET /slots, fetched on demand in the background."""

    fetched_at: float = 0.0  # monotonic; 0 = never
    slots: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    task: asyncio.Task[None] | None = None

    def want(self, state: ProxyState, now: float) -> None:
        """Start a refresh if the view is stale and none is running; never wait for it."""
        if now - self.fetched_at < SLOTS_EVERY_S or (self.task and not self.task.done()):
            return
        self.task = asyncio.get_running_loop().create_task(self._fetch(state))

    async def _fetch(self, state: ProxyState) -> None:
        try:
            body = await state.upstream.get_json("/slots", timeout_s=SLOTS_TIMEOUT_S)
            if not isinstance(body, list):
                raise UpstreamCallError("GET /slots answered with JSON that is not a list of slots")
            self.slots, self.error = [slot_summary(s) for s in body if isinstance(s, dict)], None
        except UpstreamCallError as exc:
            self.slots, self.error = [], str(exc)
        self.fetched_at = state.clock()


def slot_summary(slot: dict[str, Any]) -> dict[str, Any]:
    """One slot of llama-server's /slots, reduced to what the page shows."""
    next_token = slot.get("next_token")
    first = next_token[0] if isinstance(next_token, list) and next_token else {}
    decoded = first.get("n_decoded", 0) if isinstance(first, dict) else 0
    busy = bool(slot.get("is_processing"))
    return {
        "id": slot.get("id"),
        "state": "idle" if not busy else ("decoding" if decoded else "waiting/prefilling"),
        "n_prompt_tokens": slot.get("n_prompt_tokens"),
        "n_decoded": decoded,
        "id_task": slot.get("id_task"),
    }


class StatusBoard:
    """The recent finished requests (a record observer) and the slots view."""

    def __init__(self) -> None:
        self.recent: deque[tuple[float, Record]] = deque(maxlen=RECENT_MAX)
        """The finished generating requests' records, with the Unix time each ended."""
        self.slots = SlotsView()

    def observe_record(self, record: Record) -> None:
        if record.kind in GENERATING:
            self.recent.append((time.time(), record))

    def window(self, now_wall: float) -> list[tuple[float, Record]]:
        while self.recent and now_wall - self.recent[0][0] > RECENT_S:
            self.recent.popleft()
        return list(self.recent)


def flight_view(flight: Flight, now: float) -> dict[str, Any]:
    timer = flight.timer
    view: dict[str, Any] = {
        "id": flight.id, "kind": str(flight.kind), "phase": str(flight.phase),
        "stream": flight.stream, "client": flight.client, "purpose": flight.purpose,
        "age_s": round(now - timer.arrived, 2), "lora": flight.lora_out,
        "est_new_tokens": flight.prefill.est_new_tokens, "fed_tokens": flight.prefill.fed_tokens,
        "decoded": flight.decoded,
    }
    if flight.phase is Phase.PREFILLING:
        view["prefill"] = prefill_progress(flight, now)
    if timer.tokens:
        view["ttft_ms"] = timer.ms(timer.arrived, timer.tokens[0])
        view["rate"] = current_rate(timer.tokens, now)
        view["silent_s"] = round(now - timer.tokens[-1], 2)
    return view


def prefill_progress(flight: Flight, now: float) -> dict[str, Any]:
    """How far the prompt's computation is, from the server's progress chunks."""
    new, total, done = flight.computed_tokens, flight.prompt_tokens, flight.prefill_done_tokens
    fraction = None
    if new and total is not None and done is not None:
        fraction = round(min(max((done - (total - new)) / new, 0.0), 1.0), 3)
    started = flight.prefill_start
    return {"new_tokens": new, "prompt_tokens": total, "processed": done, "fraction": fraction,
            "elapsed_s": round(now - started, 2) if started is not None else None}


def current_rate(tokens: list[float], now: float) -> float:
    """Token events per second over the last few seconds (or since the first event)."""
    since = max(now - RATE_WINDOW_S, tokens[0])
    span = now - since
    count = len(tokens) - bisect.bisect_right(tokens, since)
    return round(count / span, 1) if span > 0.05 else 0.0


def summary(records: list[Record]) -> dict[str, Any]:
    """TTFT and stall figures over the recent finished requests."""

    def stats(values: list[float | None]) -> dict[str, float | None]:
        known = sorted(v for v in values if v is not None)
        if not known:
            return {"p50": None, "p95": None, "max": None, "n": 0}
        return {"p50": percentile(known, 50), "p95": percentile(known, 95),
                "max": known[-1], "n": len(known)}

    rates = [r.worst_3s_rate for r in records if r.worst_3s_rate is not None]
    return {
        "requests": len(records),
        "failed": sum(1 for r in records if r.outcome != "done"),
        "ttft_ms": stats([r.ttft_ms for r in records]),
        "gap_max_ms": stats([r.gap_max_ms for r in records]),
        "queue_ms": stats([r.queue_ms for r in records]),
        "stalls_1s": sum(1 for r in records if (r.gap_max_ms or 0) >= 1000),
        "worst_3s_rate_min": min(rates) if rates else None,
    }


def snapshot(state: ProxyState, ops: Operations, board: StatusBoard) -> dict[str, Any]:
    """The whole status as plain data (the JSON at /slotwise/status)."""
    now, now_wall = state.clock(), time.time()
    flights = [flight_view(f, now) for f in state.registry]
    counts = {str(p): 0 for p in Phase if p is not Phase.DONE}
    for f in flights:
        counts[f["phase"]] += 1
    window = board.window(now_wall)
    last = ops.last_reload
    return {
        "now": now_wall, "pid": ops.pid, "uptime_s": round(now_wall - ops.started_at, 1),
        "upstream": state.upstream_url, "config_gen": state.config_gen,
        "config_path": ops.config_path, "stopping": ops.stopping,
        "reloads": ops.reloads,
        "last_reload": None if last is None else {"ok": last.ok, "message": last.message,
                                                   "at": last.at, "config_gen": last.config_gen},
        "counts": counts, "flights": flights,
        "held": [f for f in flights if f["phase"] == Phase.HELD],
        "slots": {"slots": board.slots.slots, "error": board.slots.error,
                  "age_s": round(now - board.slots.fetched_at, 1)
                  if board.slots.fetched_at else None},
        "recent": {"window_s": RECENT_S, "summary": summary([r for _, r in window]),
                   "points": [{"at": at, "ttft_ms": r.ttft_ms, "gap_max_ms": r.gap_max_ms,
                               "outcome": r.outcome} for at, r in window[-300:]]},
        "config": config_to_dict(state.config),
        "timing_log": {"path": str(state.timing_log.path), "written": state.timing_log.written,
                       "lost": state.timing_log.lost},
    }


BOARD = web.AppKey("slotwise_status_board", StatusBoard)
PAGE = web.AppKey("slotwise_status_page", bytes)


async def status_json(request: web.Request) -> web.Response:
    state, board = request.app[STATE], request.app[BOARD]
    board.slots.want(state, state.clock())
    body = snapshot(state, request.app[OPS], board)
    for name, section in state.status_sections.items():  # prefill, warm, keep_kv: pushed
        body[name] = section()
    return web.json_response(body, headers={"Cache-Control": "no-store"})


async def status_page(request: web.Request) -> web.Response:
    return web.Response(body=request.app[PAGE], content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


async def to_page(request: web.Request) -> web.Response:
    raise web.HTTPFound("/slotwise/")


def install(app: web.Application) -> None:
    """The feature: /slotwise/ (the page), /slotwise/status (its JSON)."""

    async def status_ctx(app: web.Application) -> AsyncIterator[None]:
        board = StatusBoard()
        app[BOARD] = board
        app[PAGE] = resources.files("proxy.ops").joinpath("status_page.html").read_bytes()
        app[STATE].record_observers.append(board.observe_record)
        yield
        task = board.slots.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    app.cleanup_ctx.append(status_ctx)
    app.router.add_get("/slotwise", guarded(to_page))
    app.router.add_get("/slotwise/", guarded(status_page))
    app.router.add_get("/slotwise/status", guarded(status_json))  # /slots: here and proxy/keep
