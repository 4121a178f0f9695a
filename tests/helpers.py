"""Helpers shared by the tests: a fake upstream served on loopback, the config of a proxy in front
of a given upstream (conftest's `start_proxy` starts it), the records of a timing log, and a plain
HTTP call."""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import Config, parse_config
from proxy.record.flight import Flight
from proxy.record.kind import Kind
from proxy.record.timing import RequestTimer
from proxy.runner import ProxyThread


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """Serve an aiohttp app (a fake upstream) on 127.0.0.1; yields its base URL."""
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


def proxy_config(upstream_url: str, log_dir: Path, **tables: Any) -> Config:
    """A proxy's config: port 0, the timing log in `log_dir`; `tables` add to it or override."""
    upstream = {"url": upstream_url, **tables.pop("upstream", {})}
    # A short grace: a test that stops the proxy has no stream to wait for, unless it says so.
    listen = {"port": 0, "shutdown_grace_s": 3, **tables.pop("listen", {})}
    log = {"timing": str(log_dir / "timing.jsonl"), **tables.pop("log", {})}
    return parse_config({"upstream": upstream, "listen": listen, "log": log, **tables})


def read_records(source: ProxyThread | Config | Path, count: int | None = None,
                 timeout: float = 10.0) -> list[dict[str, Any]]:
    """The records of a timing log: a proxy's, a config's, or the file's at a path; with `count`,
    waits until that many are written (a record is written just after the response's last byte,
    so a fast client can look before it is there). An absent log has no records, and a record
    still being written (no newline yet) is not one yet."""
    if isinstance(source, ProxyThread):
        source = source.config
    path = Path(source.log.timing) if isinstance(source, Config) else source
    deadline = time.monotonic() + timeout
    while True:
        data = path.read_bytes() if path.exists() else b""
        lines = data[:data.rfind(b"\n") + 1].splitlines()
        if count is None or len(lines) >= count or time.monotonic() > deadline:
            return [orjson.loads(line) for line in lines]
        time.sleep(0.01)


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    content: bytes

    def json(self) -> Any:
        return orjson.loads(self.content)


def http(method: str, url: str, json: Any = None, timeout: float = 60.0,
         headers: dict[str, str] | None = None) -> Reply:
    """A plain synchronous HTTP call that returns error statuses instead of raising."""
    data = orjson.dumps(json) if json is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, {k.lower(): v for k, v in response.headers.items()},
                         response.read())
    except urllib.error.HTTPError as error:
        return Reply(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read())


def make_flight(name: str, now: float, kind: Kind = Kind.CHAT, *, stream: bool = True,
                **facts: Any) -> Flight:
    """A request's `Flight` as the handler makes it at arrival, for the tests of what reads it."""
    return Flight(id=name, kind=kind, method="POST", endpoint=f"/{kind}", wall_start=0.0,
                  config_gen=1, timer=RequestTimer(arrived=now), stream=stream, **facts)


def in_flight_by_phase(metrics_text: str) -> dict[str, float]:
    """slotwise's `slotwise_requests_in_flight` gauge, by phase, from a /metrics scrape."""
    return {s.labels["phase"]: s.value for family in text_string_to_metric_families(metrics_text)
            for s in family.samples if s.name == "slotwise_requests_in_flight"}
