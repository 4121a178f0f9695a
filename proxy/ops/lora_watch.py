"""Keeps the LoRA profile in step with the upstream: reads `GET /lora-adapters` at start (a config
that does not fit a reachable server stops the start), re-reads it in the background so that a
restarted server with other adapters is noticed, sets the server's global scales to the profile,
and checks a reloaded config before it applies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import orjson
from aiohttp import web

from proxy.config import Config
from proxy.ops.background import background
from proxy.ops.lora import (
    LoraArray,
    LoraConfigError,
    LoraListError,
    LoraProfile,
    ServerAdapter,
    global_differs,
    needs_server,
    parse_server_adapters,
)
from proxy.request.errors import LoraNotReady
from proxy.state import STATE, ProxyState
from proxy.upstream import UpstreamCallError, UpstreamClient

log = logging.getLogger("slotwise.lora")

CHECK_INTERVAL_S = 5.0
"""How often the adapter list is re-read while the upstream answers (a restart is noticed this fast)."""
RETRY_INTERVAL_S = 1.0
"""How often it is re-read while the upstream cannot be read."""
FETCH_TIMEOUT_S = 10.0
"""`GET /lora-adapters` waits for the server's current batch; longer than this counts as unreachable."""


class Unreachable(Exception):
    """The adapter list cannot be read now (down, loading, slow); worth retrying."""


async def fetch_adapters(upstream: UpstreamClient,
                         timeout_s: float = FETCH_TIMEOUT_S) -> tuple[ServerAdapter, ...]:
    """The upstream's adapters; Unreachable if it cannot answer now, LoraListError if it answers
    with something that is not an adapter list."""
    try:
        answer = await upstream.get_json("/lora-adapters", timeout_s=timeout_s)
    except UpstreamCallError as exc:
        if exc.status is None:
            raise Unreachable(str(exc)) from exc
        if exc.status == 503:
            raise Unreachable(f"{exc} (the server is still loading its model)") from exc
        raise LoraListError(str(exc)) from exc
    try:
        return parse_server_adapters(answer)
    except LoraListError as exc:
        raise LoraListError(f"GET /lora-adapters: not an adapter list: {exc}") from exc


async def set_global_scales(upstream: UpstreamClient, array: LoraArray,
                            timeout_s: float = FETCH_TIMEOUT_S) -> None:
    """`POST /lora-adapters`: make the server's global scales the profile (logged, never raised)."""
    try:
        await upstream.post_json("/lora-adapters", array, timeout_s=timeout_s)
    except UpstreamCallError as exc:
        log.warning("cannot set the upstream's global LoRA scales (will retry): %s", exc)
        return
    log.info("set the upstream's global LoRA scales to the profile: %s", orjson.dumps(array).decode())


def server_global(state: ProxyState) -> LoraArray | None:
    """The list the upstream's global LoRA scales are kept at (`_sync_global`: the profile in
    modes fixed and none), which a request without `lora` runs with; None in passthrough or while
    the profile is not ready."""
    try:
        return state.forced_lora()
    except LoraNotReady:
        return None


def _upstream_of(state: ProxyState, config: Config) -> UpstreamClient:
    """The upstream `config` names, with its key: one read and its follow-up stay on one server
    even if a reload changes the URL meanwhile."""
    return state.upstream.aimed_at(config.upstream.url, config.upstream.auth_headers())


async def _sync_global(state: ProxyState, profile: LoraProfile, upstream: UpstreamClient,
                       url: str, server: tuple[ServerAdapter, ...]) -> None:
    try:
        array = profile.array(state.config.lora, url, server)
    except LoraConfigError:
        return
    if array is not None and global_differs(array, server):
        await set_global_scales(upstream, array)


def _not_a_list(config: Config, exc: LoraListError) -> LoraConfigError:
    return LoraConfigError(f"lora.mode: {config.lora.mode!r} needs the upstream's adapter list, "
                           f"but {exc} (valid: an upstream that is llama-server, or mode "
                           "'passthrough')")


async def refresh(state: ProxyState, profile: LoraProfile) -> bool:
    """Re-read the adapter list; log what changed. False if it could not be read."""
    url, upstream = state.upstream_url, _upstream_of(state, state.config)
    try:
        server = await fetch_adapters(upstream)
    except (Unreachable, LoraListError) as exc:
        if not profile.problem:
            log.warning("cannot read the LoRA adapters of the upstream (will retry): %s", exc)
        profile.unreadable(str(exc))
        return False
    if profile.update(url, server):
        _log_profile(state.config, profile, url, server)
    await _sync_global(state, profile, upstream, url, server)
    return True


def _log_profile(config: Config, profile: LoraProfile, url: str,
                 server: tuple[ServerAdapter, ...]) -> None:
    loaded = ", ".join(a.describe() for a in server) or "none"
    try:
        array = profile.array(config.lora, url, server)
    except LoraConfigError as exc:
        log.error("the upstream's LoRA adapters changed (%s) and no longer fit the config; model "
                  "requests are refused until that is fixed: %s", loaded, exc)
        return
    log.info("LoRA adapters on the upstream: %s; mode %s forwards lora=%s", loaded,
             config.lora.mode, "as sent" if array is None else orjson.dumps(array).decode())


async def watch(state: ProxyState, profile: LoraProfile, *, interval_s: float = CHECK_INTERVAL_S,
                retry_s: float = RETRY_INTERVAL_S) -> None:
    """Re-read the adapter list for as long as the proxy runs (only in modes that need it)."""
    while True:
        ok = await refresh(state, profile) if needs_server(state.config.lora) else True
        await asyncio.sleep(interval_s if ok else retry_s)


async def first_read(state: ProxyState, profile: LoraProfile) -> None:
    """At start: a reachable upstream whose adapters do not fit the config stops the start with
    LoraConfigError; an unreachable one is retried in the background."""
    config = state.config
    upstream = _upstream_of(state, config)
    try:
        server = await fetch_adapters(upstream)
    except Unreachable as exc:
        profile.unreadable(str(exc))
        log.warning("lora.mode %r: cannot read the upstream's LoRA adapters yet (%s); model "
                    "requests get HTTP 503 until they can be read", config.lora.mode, exc)
        return
    except LoraListError as exc:
        raise _not_a_list(config, exc) from exc
    profile.update(config.upstream.url, server)
    profile.array(config.lora, config.upstream.url, server)
    _log_profile(config, profile, config.upstream.url, server)
    await _sync_global(state, profile, upstream, config.upstream.url, server)


async def check_reload(state: ProxyState, profile: LoraProfile, new: Config) -> None:
    """Refuse a reloaded config whose adapters the upstream does not have (reload check)."""
    if not needs_server(new.lora):
        return
    url = new.upstream.url
    try:
        server: tuple[ServerAdapter, ...] | None = await fetch_adapters(_upstream_of(state, new))
    except Unreachable:
        server = profile.known(url)
    except LoraListError as exc:
        raise _not_a_list(new, exc) from exc
    if server is None:
        log.warning("reload: the upstream's LoRA adapters cannot be read now; the new [lora] "
                    "config is checked when they can")
        return
    profile.array(new.lora, url, server)
    profile.update(url, server)


def install(app: web.Application, *, interval_s: float = CHECK_INTERVAL_S,
            retry_s: float = RETRY_INTERVAL_S) -> None:
    """The LoRA-profile feature: sets `state.forced_lora`, a reload check and the watcher."""
    app.cleanup_ctx.append(partial(_lifecycle, interval_s=interval_s, retry_s=retry_s))


async def _lifecycle(app: web.Application, *, interval_s: float,
                     retry_s: float) -> AsyncIterator[None]:
    state = app[STATE]
    profile = LoraProfile()
    state.forced_lora = lambda: profile.forced(state.config.lora, state.upstream_url)
    check: Callable[[Config], Awaitable[None]] = partial(check_reload, state, profile)
    state.reload_checks.append(check)
    if needs_server(state.config.lora):
        await first_read(state, profile)
    async with background(_watch_after(state, profile, interval_s, retry_s),
                          "slotwise-lora-watch"):
        yield


async def _watch_after(state: ProxyState, profile: LoraProfile, interval_s: float,
                       retry_s: float) -> None:
    """The watcher, starting with a pause after a good first read, at once after a failed one."""
    await asyncio.sleep(retry_s if profile.problem else interval_s)
    await watch(state, profile, interval_s=interval_s, retry_s=retry_s)
