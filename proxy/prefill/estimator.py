"""The estimate the gate needs before a request goes upstream: its prompt ids and how many of them
the server must compute. Chooses the tokenizer (in process when `prefill.tokenizer_model` is set,
else the upstream) and owns the cache model, which each finished request corrects with `cache_n`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

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
from proxy.estimate.ids_cache import PromptIdsCache, body_key
from proxy.estimate.prompt import check_fits
from proxy.estimate.replies import MIN_SEEN
from proxy.prefill.layout import ServerLayout, layout_advice, read_layout
from proxy.upstream import UpstreamCallError, UpstreamClient

log = logging.getLogger("slotwise.prefill")

DEFAULT_SLOTS, DEFAULT_CTX = 4, 32768
"""Used for the cache model until the upstream's `/props` has been read."""
PROPS_TIMEOUT_S = 5.0


class Estimator:
    """Prompt ids and an `Estimate` per request body; `learn` after each request and piece."""

    def __init__(self, upstream: UpstreamClient, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._upstream = upstream
        self._clock = clock
        self.ids_cache = PromptIdsCache()
        """The prompt ids of recent bodies: a body rendered for a router is not tokenized again."""
        self._server_tokenizer = UpstreamTokenizer(upstream)
        self._local: tuple[str, LocalTokenizer] | None = None
        self.cache = CacheModel(DEFAULT_SLOTS, DEFAULT_CTX)
        self._props_read = False
        self._props_lock = asyncio.Lock()
        self._replies_told = False
        self.layout = ServerLayout()
        """llama-server's slots and KV layout, once `/props` has been read."""

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
        """Raises EstimateError when the prompt cannot be known ahead (the caller fails open);
        PromptTooLong (`prompt_ids`) for a prompt longer than one slot."""
        ids = await self.prompt_ids(config, kind, body)
        if log.isEnabledFor(logging.DEBUG):
            slot, ram = self.cache.found(ids)
            log.debug("estimate: %d prompt tokens, %d of them in a slot, %d in RAM (entries: "
                      "slots %s, RAM %s; replies: %s)", len(ids), slot, ram,
                      self.cache.cached_tokens, self.cache.ram_tokens,
                      self.cache.replies.summary())
        return ids, estimate(ids, self.cache)

    async def prompt_ids(self, config: PrefillConfig, kind: str, body: Mapping[str, Any]) -> list[int]:
        """The prompt's ids as the server will see them: from the cache of recent bodies, else
        from the tokenizer in use (then cached). Raises EstimateError, and PromptTooLong for more
        ids than one slot holds, which the server refuses (found before the ids are decoded, once
        `/props` has told the slot's size: an 8 MB body's millions of ids cost 200 MB and a
        second of the event loop)."""
        limit = await self.slot_ctx(config)
        key = body_key(kind, config.tokenizer_model, body)
        ids = self.ids_cache.get(key, self._clock())
        if ids is None:
            ids = await self.tokenizer(config).tokenize_request(kind, body, limit)
            self.ids_cache.put(key, ids, self._clock(), limit=limit)
        check_fits(len(ids), limit)
        return ids

    async def slot_ctx(self, config: PrefillConfig) -> int | None:
        """One slot's context (`/props`), read first if `/props` has not answered yet; None while
        it cannot be known."""
        if not self._props_read:
            await self.read_props(config.mode)
        return self.layout.slot_ctx

    def first_piece_floor(self, ids: Sequence[int]) -> int:
        """Where a first piece of `ids` must end for llama-server to place it as it would the
        whole prompt (`CacheModel.first_piece_floor`)."""
        return self.cache.first_piece_floor(ids)

    def learn(self, ids: Sequence[int], cache_n: int | None, generated: int = 0) -> None:
        """The server processed `ids`, reported `cache_n` and generated `generated` tokens after
        them: update the cache model."""
        off = self.cache.ram_off
        self.cache.record(ids, cache_n, generated)
        replies = self.cache.replies
        if not self._replies_told and replies.count >= MIN_SEEN:
            self._replies_told = True
            log.info("%s: %s", replies.summary(), "a held reply is counted as cached" if
                     replies.found_whole() else "a held reply is counted at the share found, and "
                     "short turns that would count on one are not trimmed (a chat template that "
                     "renders replies otherwise than generated, e.g. a reasoning model's)")
        if self.cache.ram_off and not off:
            log.info("llama-server did not have a history its RAM prompt cache would have held: "
                     "taken to run without one (--cache-ram 0); prompts that left their slot now "
                     "count as computed again")
        elif off and not self.cache.ram_off:
            log.info("llama-server found a prompt beyond what its slots held: it has a RAM "
                     "prompt cache after all; prompts that leave their slot count as found there")

    async def read_props(self, mode: str) -> None:
        """Size the cache model from `/props` (slots, per-slot context), and log once what in the
        server's layout costs `mode` a lot; retried until `/props` answers. Once read, a no-op
        (start-up's read, the first request's and the learned file's may come together)."""
        async with self._props_lock:
            if not self._props_read:
                await self._read_props(mode)

    async def _read_props(self, mode: str) -> None:
        try:
            props = await self._upstream.get_json("/props", timeout_s=PROPS_TIMEOUT_S)
        except UpstreamCallError as exc:
            log.debug("cannot read /props yet: %s", exc)
            return
        try:
            models = await self._upstream.get_json("/v1/models", timeout_s=PROPS_TIMEOUT_S)
        except UpstreamCallError:
            models = None  # the layout is then partly unknown
        self._props_read = True
        self.layout = read_layout(props, models)
        if self.layout.slots and self.layout.slot_ctx:
            self.cache = CacheModel(self.layout.slots, self.layout.slot_ctx)
        for advice in layout_advice(mode, self.layout):
            log.warning("%s", advice)


ESTIMATOR = web.AppKey("slotwise_estimator", Estimator)
"""The running estimator (the cluster feature's /render uses the same tokenizer and cache)."""
