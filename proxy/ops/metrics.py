"""slotwise's own Prometheus metrics at GET /metrics, on a registry of its own per application.

Counters and most histograms are fed from the finished timing records. A stream is seen while it
runs: its queue wait and time to first token when the first token comes, its inter-token gaps at
every scrape (and the rest when it ends), so a long generation's stalls show before it is over.
The in-flight gauges are read from the in-flight registry at scrape time. A scrape never reaches
llama-server, whose own /metrics resets its rate gauges on every scrape.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from proxy.ops.guard import guarded
from proxy.record.flight import Flight, Phase, PrefillPlan
from proxy.record.schema import Record
from proxy.request.endpoints import GENERATING
from proxy.state import STATE, ProxyState

MAX_PURPOSES = 16  # purposes come from a client header: past this many, the rest count as "other"
MAX_CLIENTS = 64  # the names of [access] clients; without keys, a header or the body's `user`
LABELS = ("endpoint", "purpose")
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
RATE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
LIVE_PHASES = (Phase.ARRIVED, Phase.HELD, Phase.QUEUED, Phase.PREFILLING, Phase.DECODING,
               Phase.WAITING)


class Metrics:
    """The application's collectors, and the two observers that feed them."""

    def __init__(self, state: ProxyState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.purposes = Purposes()
        self.clients = Purposes(MAX_CLIENTS)
        reg = self.registry
        self.queue_wait = Histogram(
            "slotwise_server_queue_wait_seconds",
            "Request sent upstream -> its prefill started (the wait in llama-server's queue)",
            LABELS, buckets=WAIT_BUCKETS, registry=reg)
        self.ttft = Histogram("slotwise_time_to_first_token_seconds",
                              "Arrival at slotwise -> first token event", LABELS,
                              buckets=WAIT_BUCKETS, registry=reg)
        self.gap = Histogram("slotwise_inter_token_gap_seconds",
                             "Gaps between consecutive token events of a stream", LABELS,
                             buckets=GAP_BUCKETS, registry=reg)
        self.decode_rate = Histogram("slotwise_decode_rate_tokens_per_second",
                                     "Token events per second over each stream's decode", LABELS,
                                     buckets=RATE_BUCKETS, registry=reg)
        self.requests = Counter("slotwise_requests", "Finished requests by outcome",
                                (*LABELS, "outcome"), registry=reg)
        self.client_requests = Counter(
            "slotwise_client_requests", "Finished requests by client (the record's `client`: the "
            "name of the key with [access] clients) and outcome", ("client", "outcome"), registry=reg)
        self.lora_rewrites = Counter("slotwise_lora_rewrites",
                                     "Requests whose lora field slotwise rewrote", LABELS,
                                     registry=reg)
        self.held = Counter("slotwise_prompts_held", "Prompts the prefill policy held back",
                            LABELS, registry=reg)
        self.chunked = Counter("slotwise_prompts_chunked",
                               "Prompts the prefill policy fed in pieces", LABELS, registry=reg)
        self.slot_waits = Counter(
            "slotwise_slot_waits", "Requests held because every llama-server slot was in use "
            "(or claimed for a restore): more slots would have served them at once", LABELS,
            registry=reg)
        self.slot_wait = Counter("slotwise_slot_wait_seconds",
                                 "Time requests were held because every slot was in use", LABELS,
                                 registry=reg)
        reg.register(LiveCollector(state))
        self.state = state
        self._gaps_seen: dict[str, int] = {}
        """Streams in flight: how many of their token events have had their gap observed."""

    def labels(self, kind: str, purpose: str | None) -> tuple[str, str]:
        return kind, self.purposes.label(purpose)

    def observe_record(self, record: Record) -> None:
        """Feed one finished timing record (a `ProxyState.record_observers` entry)."""
        labels = self.labels(str(record.kind), record.purpose)
        self.requests.labels(*labels, record.outcome).inc()
        self.client_requests.labels(self.clients.label(record.client), record.outcome).inc()
        if record.lora_rewritten:
            self.lora_rewrites.labels(*labels).inc()
        plan = record.prefill_plan
        if plan == PrefillPlan.HELD:
            self.held.labels(*labels).inc()
        elif plan == PrefillPlan.CHUNKED:
            self.chunked.labels(*labels).inc()
        if record.slot_wait_ms > 0:
            self.slot_waits.labels(*labels).inc()
            self.slot_wait.labels(*labels).inc(record.slot_wait_ms / 1000.0)
        if record.kind not in GENERATING:
            return
        if not (record.stream and record.events):  # else seen at its first token
            wait = server_queue_wait_ms(record)
            if wait is not None:
                self.queue_wait.labels(*labels).observe(wait / 1000.0)
            if record.ttft_ms is not None:
                self.ttft.labels(*labels).observe(record.ttft_ms / 1000.0)
        rate = decode_rate(record)
        if rate is not None:
            self.decode_rate.labels(*labels).observe(rate)

    def on_phase(self, flight: Flight, old: Phase, new: Phase, now: float) -> None:
        """Registry listener: a stream's first token observes its queue wait and time to first
        token; its end observes the gaps not observed yet."""
        if new is Phase.DECODING and flight.stream and flight.kind in GENERATING:
            self._first_token(flight)
        elif new is Phase.DONE:
            self._observe_gaps(flight)
            self._gaps_seen.pop(flight.id, None)

    def _first_token(self, flight: Flight) -> None:
        timer, labels = flight.timer, self.labels(str(flight.kind), flight.purpose)
        if not timer.tokens:
            return
        self.ttft.labels(*labels).observe(timer.tokens[0] - timer.arrived)
        if timer.sent is not None and timer.headers is not None:
            self.queue_wait.labels(*labels).observe(timer.headers - timer.sent)

    def _observe_gaps(self, flight: Flight) -> None:
        tokens = flight.timer.tokens
        seen = self._gaps_seen.get(flight.id, 1)
        if len(tokens) <= seen:
            return
        gap = self.gap.labels(*self.labels(str(flight.kind), flight.purpose))
        for a, b in itertools.pairwise(tokens[seen - 1:]):
            gap.observe(b - a)
        self._gaps_seen[flight.id] = len(tokens)

    def exposition(self) -> bytes:
        """The scrape: first the gaps of the streams still running, then every collector."""
        for flight in self.state.registry:
            if flight.phase is Phase.DECODING:
                self._observe_gaps(flight)
        return generate_latest(self.registry)


class Purposes:
    """Bounds the `purpose` label, which comes from a client header: the first few seen keep
    their name, later ones count as "other"."""

    def __init__(self, limit: int = MAX_PURPOSES) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def label(self, purpose: str | None) -> str:
        if purpose is None:
            return "none"
        if purpose not in self.seen:
            if len(self.seen) >= self.limit:
                return "other"
            self.seen.add(purpose)
        return purpose


class LiveCollector:
    """Read at scrape time: requests in flight by phase, the config generation, the timing log's
    lost records."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        flights = GaugeMetricFamily("slotwise_requests_in_flight",
                                    "Requests in flight now, by phase (held: by the prefill "
                                    "policy; queued: sent, waiting in llama-server's queue)",
                                    labels=["phase"])
        counts = {phase: 0 for phase in LIVE_PHASES}
        for flight in self.state.registry:
            if flight.phase in counts:
                counts[flight.phase] += 1
        for phase, count in counts.items():
            flights.add_metric([phase.value], count)
        yield flights
        yield GaugeMetricFamily("slotwise_config_generation",
                                "The config generation new requests run under (+1 per reload)",
                                value=self.state.config_gen)
        yield CounterMetricFamily("slotwise_timing_records_lost",
                                  "Timing records the timing log could not take (a full disk): "
                                  "counted, never written later", value=self.state.timing_log.lost)
        not_recorded = CounterMetricFamily(
            "slotwise_refusals_not_recorded",
            "Refused requests (by outcome) counted in a summary record instead of written one by one "
            "(past the first few per peer and minute)", labels=["outcome"])
        for outcome, count in sorted(self.state.refusals.not_written.items()):
            not_recorded.add_metric([outcome], count)
        yield not_recorded


def server_queue_wait_ms(record: Record) -> float | None:
    """Streams: request sent -> headers. Non-streamed: the derived wait minus slotwise's own time."""
    if record.stream:
        return record.queue_ms
    wait, proxy = record.prefill_wait_ms, record.proxy_ms
    if wait is not None and proxy is not None:
        return max(wait - proxy, 0.0)
    return None


def decode_rate(record: Record) -> float | None:
    """Token events per second between the first and the last event."""
    events, decode_ms = record.events, record.decode_ms
    if events < 2 or decode_ms is None:
        return None
    return (events - 1) / (decode_ms / 1000.0) if decode_ms > 0 else None


METRICS = web.AppKey("slotwise_metrics", Metrics)


async def serve_metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


def install(app: web.Application) -> None:
    """The feature: GET /metrics, and the observers that feed it."""

    async def metrics_ctx(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        metrics = Metrics(state)
        app[METRICS] = metrics
        state.record_observers.append(metrics.observe_record)
        state.registry.subscribe(metrics.on_phase)
        yield

    app.cleanup_ctx.append(metrics_ctx)
    app.router.add_get("/metrics", guarded(serve_metrics))
