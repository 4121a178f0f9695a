"""Helpers shared by the tests: a fake upstream served on loopback, a proxy in a thread in front of
a given upstream, its records, and a plain HTTP call."""

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

from proxy.config import parse_config
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


def start_proxy(upstream_url: str, log_dir: Path, **tables: Any) -> ProxyThread:
    """A running proxy (stop it with `.stop()`); `tables` are extra config tables."""
    upstream = {"url": upstream_url, **tables.pop("upstream", {})}
    # A short grace: a test that stops the proxy has no stream to wait for, unless it says so.
    listen = {"port": 0, "shutdown_grace_s": 3, **tables.pop("listen", {})}
    log = {"timing": str(log_dir / "timing.jsonl"), **tables.pop("log", {})}
    config = parse_config({"upstream": upstream, "listen": listen, "log": log, **tables})
    return ProxyThread(config).__enter__()


def read_records(proxy: ProxyThread, count: int | None = None, timeout: float = 10.0
                 ) -> list[dict[str, Any]]:
    """The proxy's records; with `count`, waits until that many are written (a record is written
    just after the response's last byte, so a fast client can look before it is there)."""
    path = Path(proxy.config.log.timing)
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_bytes().splitlines() if path.exists() else []
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


def http(method: str, url: str, json: Any = None, timeout: float = 60.0) -> Reply:
    """A plain synchronous HTTP call that returns error statuses instead of raising."""
    data = orjson.dumps(json) if json is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, {k.lower(): v for k, v in response.headers.items()},
                         response.read())
    except urllib.error.HTTPError as error:
        return Reply(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read())
