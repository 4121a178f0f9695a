"""The keep_kv feature, around the `Keeper` the scheduler built (proxy/scheduler.py, installed
before it): the keeper's figures in /metrics, its section of the status page, and its start (the
probe and the files' check; its looks and saves run in the scheduler's loop). `keep_kv.enabled` and
`keep_kv.dir` change only on a restart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from aiohttp import web
from prometheus_client.core import Metric

from proxy.config import Config, ConfigError
from proxy.keep.keeper import KEEPER, Keeper
from proxy.keep.views import keep_metrics, status_view
from proxy.ops.background import background
from proxy.ops.metrics import METRICS
from proxy.state import STATE, ProxyState

RESTART_ONLY = ("enabled", "dir")
DISABLED = {"enabled": False, "note": "keep_kv.enabled is false"}


class KeepCollector:
    """The kept KV in /metrics, read at scrape time."""

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper

    def collect(self) -> Iterable[Metric]:
        k = self.keeper
        return keep_metrics(k.store, k.working, k.saves, k.restores, k.restored_tokens)


def keep_status(k: Keeper) -> dict[str, object]:
    """The status page's `keep_kv` section."""
    return status_view(k.store, k.probe, directory=str(k.files.dir), problem=k.files.shelf.problem,
                       saves=k.saves, restores=k.restores, restored_tokens=k.restored_tokens,
                       now=k.now())


def install(app: web.Application) -> None:
    app.cleanup_ctx.append(_lifecycle)


def restart_only(state: ProxyState) -> None:
    async def check(new: Config) -> None:
        for key in RESTART_ONLY:
            old_value, new_value = getattr(state.config.keep_kv, key), getattr(new.keep_kv, key)
            if old_value != new_value:
                raise ConfigError(f"keep_kv.{key}: {new_value!r} takes effect only on a restart "
                                  f"(valid on reload: the running value {old_value!r})")

    state.reload_checks.append(check)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    restart_only(state)
    if KEEPER not in app:
        state.status_sections["keep_kv"] = lambda: DISABLED
        yield
        return
    keeper = app[KEEPER]
    keeper.load()
    state.status_sections["keep_kv"] = lambda: keep_status(keeper)
    state.registry.subscribe(keeper.on_phase)
    state.reload_hooks.append(lambda new: keeper.reconfigure(new.keep_kv))
    if METRICS in app:
        app[METRICS].registry.register(KeepCollector(keeper))
    async with background(keeper.open(), "slotwise-keep-start"):
        yield
