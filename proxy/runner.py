"""Runs a slotwise proxy on its own event loop in a background thread: for tests, benchmarks and
the demo, where the caller (a sync client, a load generator) needs its own thread.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from aiohttp import web

from proxy.app import start
from proxy.config import Config
from proxy.ops.lifecycle import drain
from proxy.state import STATE, ProxyState


class ProxyThread:
    """`with ProxyThread(config) as proxy:` serves on `proxy.url` until the block ends."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slotwise-proxy",
                                        daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        self._runner, self.url = self.call(start(self.config))
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def app(self) -> web.Application:
        assert self._runner is not None, "the proxy is not running"
        return self._runner.app

    @property
    def state(self) -> ProxyState:
        return self.app[STATE]

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the proxy's loop and wait for its result."""
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def stop(self) -> None:
        if self._runner is not None:
            # As on SIGTERM: requests in flight may finish within the grace period, then are cut.
            grace = self.config.listen.shutdown_grace_s
            self.call(drain(self._runner), timeout=grace + 15.0)
            self._runner = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()
