"""What the running proxy holds: the config in force, the one upstream session and the client for
slotwise's own calls over it, the in-flight registry, the timing log, and the seams the features hook
into (record observers, reload checks and hooks, status sections), under one typed application key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config import Config
from proxy.record.ids import RequestIds
from proxy.record.inflight import Registry
from proxy.record.refusals import RefusalSampler, summary_record
from proxy.record.schema import Record
from proxy.record.timing_log import TimingLog
from proxy.upstream import UpstreamClient

log = logging.getLogger("slotwise")

def _no_forced_lora() -> list[dict[str, Any]] | None:
    return None


@dataclass
class ProxyState:
    config: Config
    timing_log: TimingLog
    session: aiohttp.ClientSession = field(repr=False)
    upstream: UpstreamClient = field(init=False, repr=False)
    """slotwise's own calls to llama-server, over `session`, with the URL and key in force."""
    registry: Registry = field(default_factory=Registry)
    ids: RequestIds = field(default_factory=RequestIds)
    """Issues every request's unique id (the client's own X-Request-Id when it is free)."""
    forced_lora: Callable[[], list[dict[str, Any]] | None] = _no_forced_lora
    """The explicit `lora` array every request gets (LoRA modes fixed/none), or None."""
    config_gen: int = 1
    clock: Callable[[], float] = time.monotonic
    reload_checks: list[Callable[[Config], Awaitable[None]]] = field(default_factory=list)
    """Run on a new config before it takes effect; one that raises ConfigError refuses it."""
    reload_hooks: list[Callable[[Config], None]] = field(default_factory=list)
    """Told of a new config once it has taken effect (the prefill gate re-reads its table)."""
    record_observers: list[Callable[[Record], None]] = field(default_factory=list)
    """Called with every finished timing record (metrics, the status page)."""
    status_sections: dict[str, Callable[[], object]] = field(default_factory=dict)
    """The status page's sections the features push (prefill, warm, keep_kv): name -> its view,
    read at each request of /slotwise/status."""
    stopping: bool = False
    """Set at SIGTERM: requests cut when the grace period ends are recorded as such."""
    refusals: RefusalSampler = field(default_factory=RefusalSampler)
    """Which refused requests' records are written whole, and the summaries of the others."""

    def __post_init__(self) -> None:
        self.upstream = UpstreamClient(self.session, lambda: self.upstream_url, self.own_headers)

    async def apply_config(self, new: Config) -> None:
        """Make `new` the config for requests that arrive from now on (streams in flight keep
        theirs); a check that raises ConfigError leaves the running config as it was."""
        for check in self.reload_checks:
            await check(new)
        self.config = new
        self.config_gen += 1
        for hook in self.reload_hooks:
            hook(new)

    def emit(self, record: Record, *, peer: str | None = None, sample: bool = False) -> None:
        """The one way a record is written: to the timing log and to every observer. `sample`: a
        request's record, which the log may only count if it is a refusal from `peer`, for a summary
        (`proxy/record/refusals.py`); every other record is written whole. Observers see it always."""
        if not sample or self.refusals.admit(record, peer, self.clock()):
            self.timing_log.write(record)
        for observer in self.record_observers:
            try:
                observer(record)
            except Exception:  # a failing observer never harms the request
                log.exception("a record observer failed on %s", record.id)

    def emit_summaries(self, *, every: bool = False) -> None:
        """The summaries of the refusals not written whole, whose minute is over (`every`: all of
        them, slotwise is stopping). The log only: they stand for requests the observers saw."""
        summaries = self.refusals.flush() if every else self.refusals.due(self.clock())
        for summary in summaries:
            rid = self.ids.issue(None, lambda taken: self.registry.get(taken) is not None)
            self.timing_log.write(summary_record(summary, rid, self.refusals.whole))

    def own_headers(self) -> dict[str, str]:
        """Headers for slotwise's own calls to the upstream (the API key of the config in force,
        so a reload that changes it applies at once); forwarded requests never get them."""
        return self.config.upstream.auth_headers()

    @property
    def upstream_url(self) -> str:
        return self.config.upstream.url

    @property
    def max_body_bytes(self) -> int:
        return int(self.config.listen.max_body_mb * 1024 * 1024)


STATE = web.AppKey("slotwise_state", ProxyState)
