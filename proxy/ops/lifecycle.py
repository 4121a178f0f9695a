"""Reload and shutdown, as an operator asks for them with signals. SIGHUP re-reads the config file:
a valid one takes effect for new requests (streams in flight keep theirs), an invalid one is refused
with the same error as at start and the running one stays; either way the timing log is opened anew
(so a log rotation that moved the file takes effect), at `log.timing`'s new path if it changed.
SIGTERM or SIGINT stops accepting, lets the requests in flight finish within
`listen.shutdown_grace_s`, and closes the timing log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from proxy.config import Config, ConfigError, load_config
from proxy.listener import CUT_WAIT_S, LISTENER
from proxy.record.timing_log import cannot_open, open_append
from proxy.state import STATE, ProxyState

log = logging.getLogger("slotwise")
ReloadCheck = Callable[[Config], Awaitable[None]]

# Keys read once at start: a reload that changes one is refused rather than half applied.
RESTART_ONLY = (
    ("listen", "host"), ("listen", "port"), ("listen", "shutdown_grace_s"),
    ("upstream", "connect_timeout_s"), ("upstream", "read_timeout_s"),
)


@dataclass(frozen=True)
class ReloadResult:
    ok: bool
    config_gen: int  # the generation in force afterwards
    message: str
    at: float = field(default_factory=time.time)  # wall clock


@dataclass
class Operations:
    """What the status page and `slotwise reload` learn about the process itself."""

    config_path: str | None = None
    started_at: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    reloads: int = 0  # attempts, accepted or refused
    last_reload: ReloadResult | None = None
    stopping: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)


OPS = web.AppKey("slotwise_operations", Operations)


def restart_only_check(state: ProxyState) -> ReloadCheck:
    """A reload check that refuses changes to keys that only a restart can apply."""

    async def check(new: Config) -> None:
        for section, key in RESTART_ONLY:
            old_value = getattr(getattr(state.config, section), key)
            new_value = getattr(getattr(new, section), key)
            if old_value != new_value:
                raise ConfigError(
                    f"{section}.{key}: {new_value!r} takes effect only on a restart "
                    f"(valid on reload: the running value {old_value!r})")

    return check


def timing_log_check(state: ProxyState) -> ReloadCheck:
    """A reload check that refuses a `log.timing` that cannot be opened (the running log stays)."""

    async def check(new: Config) -> None:
        path = Path(new.log.timing)
        if path == state.timing_log.path:
            return
        try:
            os.close(open_append(path))
        except OSError as exc:
            raise cannot_open(path, exc) from exc

    return check


def reopen_timing_log(state: ProxyState, path: str | None = None) -> None:
    """Open the timing log anew (at `path`, else where it is); if that fails, the old file stays."""
    try:
        state.timing_log.reopen(path)
    except OSError as exc:
        log.error("the timing log stays at %s: %s", state.timing_log.path, cannot_open(
            path or state.timing_log.path, exc))


async def reload_config(state: ProxyState, ops: Operations, path: str | Path) -> ReloadResult:
    """Read `path` and make it the config for new requests, or refuse it and say why."""
    async with ops.lock:
        ops.reloads += 1
        try:
            new = load_config(path)
            await state.apply_config(new)
        except Exception as exc:  # a ConfigError, or a fault slotwise did not foresee in the file
            what = "config error" if isinstance(exc, ConfigError) else "failed"
            result = ReloadResult(False, state.config_gen, f"{what}: {exc}")
            log.error("config reload refused, generation %d stays in force: %s",
                      state.config_gen, result.message, exc_info=not isinstance(exc, ConfigError))
            reopen_timing_log(state)  # a rotation's SIGHUP still moves the log to the new file
        else:
            logging.getLogger().setLevel(new.log.level.upper())
            result = ReloadResult(True, state.config_gen,
                                  f"{path}: generation {state.config_gen} in force")
            log.info("config reloaded from %s: generation %d in force for new requests",
                     path, state.config_gen)
        ops.last_reload = result
        return result


async def run_until_stopped(runner: web.AppRunner) -> None:
    """Serve until SIGTERM or SIGINT, reloading on SIGHUP; then drain and clean up."""
    app = runner.app
    state, ops = app[STATE], app[OPS]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reloads: set[asyncio.Task[ReloadResult]] = set()

    def on_hangup() -> None:
        if ops.config_path is None:
            log.error("SIGHUP: no config file to reload (started without --config)")
            reopen_timing_log(state)
            return
        task = loop.create_task(reload_config(state, ops, ops.config_path))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the drain
            loop.add_signal_handler(sig, lambda: log.warning(
                "already stopping: %d requests still in flight", len(state.registry)))
    finally:
        try:
            await drain(runner)
        finally:
            for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


async def drain(runner: web.AppRunner) -> None:
    """Stop accepting; give the requests in flight up to the grace period; close everything."""
    state, ops = runner.app[STATE], runner.app[OPS]
    ops.stopping = True
    state.stopping = True
    grace = state.config.listen.shutdown_grace_s
    log.info("slotwise stopping: %d requests in flight, waiting up to %g s for them",
             len(state.registry), grace)
    for site in list(runner.sites):  # no new connections
        await site.stop()
    listener = runner.app[LISTENER]
    listener.stop_taking_requests()
    cut = await listener.finish_requests(grace, CUT_WAIT_S)  # the grace, counted once
    if cut:
        log.warning("slotwise stopping: %d requests cut at the end of the %g s grace period",
                    cut, grace)
    await runner.cleanup()
    log.info("slotwise stopped; %d timing records written to %s",
             state.timing_log.written, state.timing_log.path)


def install(app: web.Application) -> None:
    """The feature: the process's operations record, the reload check for restart-only keys, and
    the timing log's reopening on every reload."""

    async def operations_ctx(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        app[OPS] = Operations()
        state.reload_checks.append(restart_only_check(state))
        state.reload_checks.append(timing_log_check(state))
        state.reload_hooks.append(lambda new: reopen_timing_log(state, new.log.timing))
        yield

    app.cleanup_ctx.append(operations_ctx)

