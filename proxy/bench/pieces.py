"""`slotwise bench pieces`: what one piece of a fed cold prompt costs on a llama-server.

A piece is one batch, and llama-server cannot interrupt a batch: every stream, and every request
that arrives meanwhile, waits until it ends. This measures, with streams decoding, the batch time of
pieces of several sizes after a long cached prefix, beside a short turn's own prompt time in the same
conditions: the figures to choose `prefill.max_stall_ms` from, on the testbed or on your own server.
After several prefixes, the batch-cost model slotwise would fit from these pieces, what it makes of
them (the largest piece within `max_stall_ms`, the way on it would choose), and the server's layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.layout import ServerLayout, read_layout
from proxy.prefill.outlook import ChunkKnobs, Situation, fitting_piece
from proxy.prefill.strategy import PieceChoice, choose_piece
from proxy.testbed.words import filler

SIZES = (64, 128, 256, 512)
"""`chunk`'s pieces are multiples of 64 tokens (`prefill.sizing.PIECE_ALIGN`). Under 64 rows a
micro-batch takes ggml's one-row CPU attention instead of the 64-row tiled one (ggml-cpu/ops.cpp,
`use_tiled`: `neq1 >= GGML_FA_TILE_Q`): on the testbed 32 tokens after 15,000 took 1.54 s, 64
took 0.88 s."""


@dataclass(frozen=True)
class PieceCost:
    tokens: int
    prefix: int
    """Tokens already cached before this piece."""
    prompt_ms: float
    """The server's own `timings.prompt_ms` for the piece: the batch it took."""
    wall_ms: float
    """Sent to answered, as slotwise sees it."""


@dataclass
class PieceFigures:
    streams: int
    pieces: list[PieceCost] = field(default_factory=list)
    short_prompt_ms: list[float] = field(default_factory=list)
    """A short turn's own `prompt_ms`, sent between the pieces (same streams decoding)."""

    def as_dict(self) -> dict[str, Any]:
        return {"streams": self.streams, "short_prompt_ms": self.short_prompt_ms,
                "pieces": [p.__dict__ for p in self.pieces]}

    def extend(self, other: PieceFigures) -> None:
        self.pieces.extend(other.pieces)
        self.short_prompt_ms.extend(other.short_prompt_ms)


@dataclass(frozen=True)
class PrefixOutlook:
    """What the fitted model makes of one prefix: the piece `chunk` would size, and its choice."""

    prefix: int
    fitting_piece: int
    fitting_ms: float
    choice: PieceChoice


COLD_REST = 3300
"""The rest a choice is shown for: the contention benchmark's cold prompt."""


def fit_pieces(figures: PieceFigures) -> BatchCostModel:
    """The batch-cost model slotwise would fit from these pieces (`figures.streams` decoding)."""
    model = BatchCostModel()
    for p in figures.pieces:
        model.observe_piece(p.tokens, p.prefix, p.prompt_ms, figures.streams)
    return model


def costs_toml(figures: PieceFigures, where: str, server_args: str | None) -> str:
    """The pieces as a `slotwise whatif --costs` file (`[measured] pieces`): the what-if fits them
    beside its log's own prompts (proxy/whatif/costs.py)."""
    flags = f" (llama-server {server_args})" if server_args else ""
    rows = "".join(f"  [{p.tokens}, {p.prefix}, {p.prompt_ms:.2f}, {figures.streams}],\n"
                   for p in figures.pieces)
    return (f"# slotwise bench pieces: {where}{flags}, {figures.streams} streams decoding\n"
            "# rows: [tokens, tokens cached before, the server's prompt_ms, slots decoding]\n"
            f"[measured]\npieces = [\n{rows}]\n")


def outlooks(model: BatchCostModel, prefixes: Sequence[int], streams: int,
             knobs: ChunkKnobs) -> list[PrefixOutlook]:
    """At each prefix: the largest piece within `max_stall_ms` and the way on `chunk` would choose
    for a 3,300-token rest with `streams` generating."""
    cost = model.cost
    out = []
    for prefix in prefixes:
        sit = Situation(done_tokens=prefix, remaining_tokens=COLD_REST, decoders=streams)
        fit = fitting_piece(cost, sit, knobs)
        out.append(PrefixOutlook(prefix, fit, cost.batch_ms(fit, prefix, streams),
                                 choose_piece(cost, sit, knobs)))
    return out


async def server_layout(url: str, headers: dict[str, str] | None = None) -> ServerLayout:
    """The layout llama-server shows (`/props`, `/v1/models`); what it cannot show stays None."""
    async with aiohttp.ClientSession(headers=headers) as session:
        found = []
        for path in ("/props", "/v1/models"):
            try:
                async with session.get(url + path) as response:
                    found.append(await response.json() if response.status == 200 else None)
            except (aiohttp.ClientError, ValueError):
                found.append(None)
    return read_layout(*found)


async def measure(url: str, *, prefix: int = 3000, sizes: Sequence[int] = SIZES,
                  streams: int = 3, headers: dict[str, str] | None = None,
                  seed: int | None = None) -> PieceFigures:
    """Feed a `prefix`-token prompt, then one piece of each size on top of it, while `streams`
    completions decode; a short turn after each piece. Needs `streams + 2` free slots."""
    rng = random.Random(seed)
    figures = PieceFigures(streams=streams)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        ids = await _token_ids(session, url, prefix + sum(sizes), rng)
        decoders = [asyncio.create_task(_decode(session, url, i)) for i in range(streams)]
        try:
            await asyncio.sleep(1.0 if streams else 0.0)
            done = prefix
            await _complete(session, url, {"prompt": ids[:done], "n_predict": 0})
            for i, size in enumerate(sizes):
                sent = time.monotonic()
                timings = await _complete(session, url, {"prompt": ids[:done + size],
                                                         "n_predict": 0})
                figures.pieces.append(PieceCost(
                    tokens=int(timings["prompt_n"]), prefix=done,
                    prompt_ms=float(timings["prompt_ms"]),
                    wall_ms=(time.monotonic() - sent) * 1000.0))
                done += size
                short = await _complete(session, url, {
                    "prompt": f"short turn {i} {rng.random():.6f}: thanks! yes or no?",
                    "n_predict": 1})
                figures.short_prompt_ms.append(float(short["prompt_ms"]))
        finally:
            for task in decoders:
                task.cancel()
            for task in decoders:
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await task
    return figures


async def _token_ids(session: aiohttp.ClientSession, url: str, count: int,
                     rng: random.Random) -> list[int]:
    text = filler(rng, count)
    async with session.post(url + "/tokenize", json={"content": text}) as response:
        response.raise_for_status()
        ids = (await response.json())["tokens"]
    if len(ids) < count:
        raise RuntimeError(f"/tokenize gave {len(ids)} tokens for {count} words; expected more")
    return [int(t) for t in ids[:count]]


async def _complete(session: aiohttp.ClientSession, url: str,
                    body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url + "/completion", json={**body, "cache_prompt": True}) as response:
        if response.status != 200:
            raise RuntimeError(f"/completion answered {response.status}: "
                               f"{(await response.text())[:300]}")
        timings: dict[str, Any] = (await response.json())["timings"]
        return timings


async def _decode(session: aiohttp.ClientSession, url: str, i: int) -> None:
    """A stream that decodes until cancelled."""
    body = {"prompt": f"stream {i}: tell me a long story.", "n_predict": 100_000,
            "ignore_eos": True, "stream": True}
    async with session.post(url + "/completion", json=body) as response:
        async for _ in response.content.iter_any():
            pass
