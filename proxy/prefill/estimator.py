"""The estimate the gate needs before a request goes upstream: its prompt ids and how many of them
the server must compute. Chooses the tokenizer (in process when `prefill.tokenizer_model` is set,
else the upstream) and owns the cache model, which each finished request corrects with `cache_n`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.config import ConfigError, PrefillConfig
from proxy.estimate import (
    CacheModel,
    Estimate,
    EstimateError,
    LocalTokenizer,
    PromptTokenizer,
    UpstreamTokenizer,
    estimate,
)
from proxy.upstream import UpstreamCallError, UpstreamClient

log = logging.getLogger("slotwise.prefill")

DEFAULT_SLOTS, DEFAULT_CTX = 4, 32768
"""Used for the cache model until the upstream's `/props` has been read."""
PROPS_TIMEOUT_S = 5.0


class Estimator:
    """Prompt ids and an `Estimate` per request body; `learn` after each request and piece."""

    def __init__(self, upstream: UpstreamClient) -> None:
        self._upstream = upstream
        self._server_tokenizer = UpstreamTokenizer(upstream)
        self._local: tuple[str, LocalTokenizer] | None = None
        self.cache = CacheModel(DEFAULT_SLOTS, DEFAULT_CTX)
        self._props_read = False
        self.upstream_slots: int | None = None
        """llama-server's slot count, once `/props` has been read."""

    async def prepare(self, config: PrefillConfig) -> None:
        """Load the in-process tokenizer `config` names (ConfigError if it cannot be loaded)."""
        path = config.tokenizer_model
        if not path or (self._local is not None and self._local[0] == path):
            return
        try:
            self._local = (path, await LocalTokenizer.open(path, self._server_tokenizer))
        except EstimateError as exc:
            raise ConfigError(f"prefill.tokenizer_model: {exc} (valid: the GGUF file the "
                              "upstream serves, or \"\" to ask the upstream)") from exc

    def tokenizer(self, config: PrefillConfig) -> PromptTokenizer:
        if config.tokenizer_model and self._local and self._local[0] == config.tokenizer_model:
            return self._local[1]
        return self._server_tokenizer

    async def estimate(self, config: PrefillConfig, kind: str,
                       body: Mapping[str, Any]) -> tuple[list[int], Estimate]:
        """Raises EstimateError when the prompt cannot be known ahead (the caller fails open)."""
        if not self._props_read:
            await self.read_props()
            advice = slot_advice(config.mode, self.upstream_slots)
            if advice:
                log.warning("%s", advice)
        ids = await self.tokenizer(config).tokenize_request(kind, body)
        return ids, estimate(ids, self.cache)

    def learn(self, ids: Sequence[int], cache_n: int | None) -> None:
        """The server processed `ids` and reported `cache_n`: update the cache model."""
        self.cache.record(ids, cache_n)

    async def read_props(self) -> None:
        """Size the cache model from `/props` (slots, per-slot context); retried until it works."""
        try:
            props = await self._upstream.get_json("/props", timeout_s=PROPS_TIMEOUT_S)
        except UpstreamCallError as exc:
            log.debug("cannot read /props yet: %s", exc)
            return
        self._props_read = True
        slots, ctx = _slots_and_ctx(props)
        self.upstream_slots = slots
        if slots and ctx:
            self.cache = CacheModel(slots, ctx)


MIN_CHUNK_SLOTS = 3
"""`chunk` needs a slot for the prompt being fed, one per stream, and one free for short turns."""


def slot_advice(mode: str, slots: int | None) -> str | None:
    """A warning when the server has too few slots for `chunk` to keep short turns quick."""
    if mode != "chunk" or slots is None or slots >= MIN_CHUNK_SLOTS:
        return None
    return (f"prefill.mode = chunk, but llama-server has {slots} slot(s): a short turn will take "
            "the slot of the prompt being fed and llama-server will copy that prefix to RAM and "
            "back; run it with -np N, N = the streams you expect at peak plus two "
            "(docs/prefill.md, 'llama-server flags that work best')")


def _slots_and_ctx(props: Any) -> tuple[int | None, int | None]:
    if not isinstance(props, dict):
        return None, None
    settings = props.get("default_generation_settings")
    ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    slots = props.get("total_slots")
    return (slots if isinstance(slots, int) and slots > 0 else None,
            ctx if isinstance(ctx, int) and ctx > 0 else None)
