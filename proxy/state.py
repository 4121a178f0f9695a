"""What the running proxy holds: the config in force, the one upstream session, the in-flight
registry, the timing log and the gate, under one typed application key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.admission import Gate, OpenGate
from proxy.config import Config
from proxy.inflight import Registry
from proxy.timing_log import TimingLog

log = logging.getLogger("slotwise")

def _no_forced_lora() -> list[dict[str, Any]] | None:
    return None


@dataclass
class ProxyState:
    config: Config
    timing_log: TimingLog
    session: aiohttp.ClientSession = field(repr=False)
    registry: Registry = field(default_factory=Registry)
    gate: Gate = field(default_factory=OpenGate)
    forced_lora: Callable[[], list[dict[str, Any]] | None] = _no_forced_lora
    """The explicit `lora` array every request gets (LoRA modes fixed/none), or None."""
    config_gen: int = 1
    clock: Callable[[], float] = time.monotonic
    reload_checks: list[Callable[[Config], Awaitable[None]]] = field(default_factory=list)
    """Run on a new config before it takes effect; one that raises ConfigError refuses it."""
    record_observers: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)
    """Called with every finished timing record (metrics, the status page)."""
    stopping: bool = False
    """Set at SIGTERM: requests cut when the grace period ends are recorded as such."""

    async def apply_config(self, new: Config) -> None:
        """Make `new` the config for requests that arrive from now on (streams in flight keep
        theirs); a check that raises ConfigError leaves the running config as it was."""
        for check in self.reload_checks:
            await check(new)
        self.config = new
        self.config_gen += 1

    def observe_record(self, record: dict[str, Any]) -> None:
        """Hand a finished record to every observer; a failing observer never harms the request."""
        for observer in self.record_observers:
            try:
                observer(record)
            except Exception:
                log.exception("a record observer failed on %s", record.get("id"))

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
