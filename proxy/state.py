"""What the running proxy holds: the config in force, the one upstream session, the in-flight
registry, the timing log and the gate, under one typed application key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.admission import Gate, OpenGate
from proxy.config import Config
from proxy.inflight import Registry
from proxy.timing_log import TimingLog


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

    @property
    def upstream_url(self) -> str:
        return self.config.upstream.url

    @property
    def max_body_bytes(self) -> int:
        return int(self.config.listen.max_body_mb * 1024 * 1024)


STATE = web.AppKey("slotwise_state", ProxyState)
