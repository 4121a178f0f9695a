"""The prefill feature: builds the estimator, the piece feeder and the gate for a running proxy,
makes the gate `state.gate`, subscribes it to the registry, and runs its tick loop.

A `prefill.tokenizer_model` that cannot be loaded stops the start (or refuses the reload).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from proxy.config import Config
from proxy.ops.background import background
from proxy.prefill.estimator import Estimator
from proxy.prefill.feeder import PieceFeeder
from proxy.prefill.gate import PrefillGate
from proxy.state import STATE

GATE = web.AppKey("slotwise_prefill_gate", PrefillGate)
ESTIMATOR = web.AppKey("slotwise_estimator", Estimator)
"""The prompt ids of a body (the cluster feature's /render uses the same tokenizer and cache)."""


def install(app: web.Application) -> None:
    app.cleanup_ctx.append(_lifecycle)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    estimator = Estimator(state.upstream)
    await estimator.prepare(state.config.prefill)

    async def check(new: Config) -> None:
        await estimator.prepare(new.prefill)

    gate = PrefillGate(config=state.config.prefill, estimator=estimator,
                       feeder=PieceFeeder(state.upstream),
                       registry=state.registry, clock=state.clock)
    app[GATE] = gate
    app[ESTIMATOR] = estimator
    state.gate = gate
    state.registry.subscribe(gate.on_phase)
    state.reload_checks.append(check)
    state.reload_hooks.append(lambda new: gate.reconfigure(new.prefill))
    async def read_layout() -> None:  # at start (and its warning), not at the first request
        if state.config.prefill.mode != "off":
            await estimator.read_props(state.config.prefill.mode)

    try:
        async with background(gate.run(), "slotwise-prefill-tick"), \
                background(read_layout(), "slotwise-layout"):
            yield
    finally:
        await gate.close()
