"""The scheduler of llama-server's time, composed, above `prefill/` and the `warm/` and `keep/` built
on it: the estimator, the pure policy, the keeper of saved KV (keep_kv, when enabled) and the
warm-ups are built here together and handed to the gate as constructor arguments
(`prefill/hooks.py`), sharing one wake-up event; the gate is published as the handler's
`ADMISSION`, hears the registry, runs the one loop that acts on llama-server's time (the warm-ups
tick in it), and pushes its status section and gauges to the ops pages. What the policy and the
estimator learned of the server is read from and written to `prefill.learned_file` here. The warm
and keep features add their routes, metrics, status and the keeper's start around the parts built
here.

A `prefill.tokenizer_model` that cannot be loaded stops the start (or refuses the reload).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import partial

from aiohttp import web

from proxy.config import Config
from proxy.keep.keeper import KEEPER, Keeper
from proxy.ops.background import background
from proxy.ops.lora_watch import server_global
from proxy.ops.metrics import METRICS
from proxy.prefill.estimator import ESTIMATOR, Estimator
from proxy.prefill.feeder import PieceFeeder
from proxy.prefill.gate import PrefillGate
from proxy.prefill.learned_file import LearnedFile
from proxy.prefill.policy import PrefillPolicy
from proxy.prefill.views import PrefillCollector, prefill_view
from proxy.request.admission import ADMISSION
from proxy.state import STATE
from proxy.warm.routes import WARMER
from proxy.warm.warmer import Warmer


def install(app: web.Application) -> None:
    app.cleanup_ctx.append(_lifecycle)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    config = state.config
    estimator = Estimator(state.upstream)
    await estimator.prepare(config.prefill)

    async def check(new: Config) -> None:
        await estimator.prepare(new.prefill)

    policy = PrefillPolicy(config.prefill, n_batch=config.prefill.n_batch)
    feeder = PieceFeeder(state.upstream, global_lora=partial(server_global, state))
    wake = asyncio.Event()
    keeper = Keeper(state, estimator, wake=wake) if config.keep_kv.enabled else None
    warmer = Warmer(state, estimator, feeder, wake, keep=keeper)
    gate = PrefillGate(config=config.prefill, estimator=estimator, feeder=feeder,
                       registry=state.registry, clock=state.clock, policy=policy, keep=keeper,
                       warm=warmer, wake=wake)
    app[ADMISSION], app[ESTIMATOR], app[WARMER] = gate, estimator, warmer
    if keeper is not None:
        app[KEEPER] = keeper
    state.status_sections["prefill"] = lambda: prefill_view(gate.snapshot())
    if METRICS in app:
        app[METRICS].registry.register(PrefillCollector(gate.snapshot))
    state.registry.subscribe(gate.on_phase)
    state.reload_checks.append(check)
    state.reload_hooks.append(lambda new: gate.reconfigure(new.prefill))

    async def read_layout() -> None:  # at start (and its warning), not at the first request
        if state.config.prefill.mode != "off" or keeper is not None:
            await estimator.read_props(state.config.prefill.mode)

    learned = (LearnedFile(config.prefill.learned_file, policy, estimator, config.prefill.n_batch)
               if config.prefill.learned_file else None)
    if learned is not None:
        state.status_sections["learned_file"] = lambda: {"path": str(learned.path),
                                                          "status": learned.status}
    try:
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(background(gate.run(), "slotwise-prefill-tick"))
            await stack.enter_async_context(background(read_layout(), "slotwise-layout"))
            if learned is not None:
                await stack.enter_async_context(
                    background(learned.run(config.prefill), "slotwise-learned"))
            yield
    finally:
        await gate.close()
        if learned is not None:
            await learned.save()
