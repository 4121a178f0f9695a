"""What a day's log shows of the server's costs: one observation per prompt computed with no other
prompt beside it, and per reply's decode steps with the other prompts' time taken out, in the batch
cost's features (`PrefillObs.row`); and what a change of LoRA settings added. calibrate.py fits the
costs to them. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from proxy.prefill.narrow import MIN_KCELLS
from proxy.prefill.sizing import TILE_ROWS
from proxy.report.model import Span
from proxy.report.spanindex import SpanIndex
from proxy.whatif.costs import Costs
from proxy.whatif.settings import ServerSettings
from proxy.whatif.stepcost import PromptRun, narrow_kcells, prompt_alone_ms

MIN_PROMPT = 256
"""Shorter prompts are mostly per-request work (the prefill policy learns from none either)."""
MIN_STEPS = 16
"""Replies of fewer decode steps tell too little of a step's time."""
MIN_SWITCHES = 3
"""Prompts computed alone after a change of LoRA settings, and after none, before a switch is priced."""
MIN_CLEAN_SHARE = 0.5
"""A reply's decode time must be at least this much free of other prompts to be a decode observation."""


@dataclass(frozen=True)
class PrefillObs:
    tokens: int
    ctx: int
    ms: float
    decoders: float
    batches: int
    """Batches (decode calls) it took."""
    micro: int
    """Micro-batches of its prompt tokens."""
    apart: float = 0.0
    """Micro-batches of the decode tokens beside it (a KV per slot gives them their own)."""
    dec_kctx: float = 0.0
    """Thousands of cells the decode tokens beside it attend to, each batch (their own cells)."""
    others_kv: float = 0.0
    """Thousands of cells of one shared KV's span beyond its own meanwhile (kvcells.py; from the
    timing log alone, the cells the other requests held)."""
    narrow: float = 0.0
    """Thousands of cells its prompt tokens in micro-batches under TILE_ROWS rows attend to, all
    together (`stepcost.narrow_kcells`): computed one row at a time."""
    tiled: bool = True
    """One shared KV: the decode tokens beside it rode in a micro-batch of TILE_ROWS rows or
    more (its query tiles); fewer go one row at a time, as in a decode step."""

    def row(self, n_ubatch: int) -> tuple[float, float, float, float, float, float, float]:
        """Its features, in the order a, b, c, e, g of the batch cost, then the decode tokens'
        cells in micro-batches shared with it and the span's other cells its mask covers (both
        one shared KV)."""
        ub = max(1, n_ubatch)
        read = self.micro * self.ctx + ub * self.micro * (self.micro - 1) / 2
        shared = self.dec_kctx * self.batches if self.tiled and not self.apart else 0.0
        return (self.micro + self.apart, float(self.tokens),
                self.tokens * (self.ctx + self.tokens / 2) / 1000.0,
                self.decoders * self.batches, read / 1000.0, shared,
                0.0 if self.apart else self.tokens * self.others_kv)


@dataclass(frozen=True)
class DecodeObs:
    steps: int
    step_ms: float
    slots: float
    kctx: float
    """Thousands of cells attended per step, all its decode tokens together."""
    scanned: float = 0.0
    """Thousands of cells of one shared KV's span read per step beyond those, all together."""


def prompt_obs(tokens: int, ctx: int, ms: float, decoders: float, server: ServerSettings,
               dec_kctx: float = 0.0, others_kv: float = 0.0, chained: bool = False
               ) -> PrefillObs:
    """`chained`: a KV per slot, the slot just below decoding (`stepcost.PromptRun.chained`)."""
    n_batch, ub, unified = max(1, server.n_batch), max(1, server.n_ubatch), server.kv_unified
    batches = max(1, math.ceil(tokens / n_batch))
    apart = 0.0 if unified else batches * min(1.0, decoders)
    last = tokens - (batches - 1) * n_batch  # the last batch's prompt tokens
    riding = round(decoders)
    narrow = narrow_kcells(riding, (PromptRun(last, ctx + tokens - last, chained=chained),), ub,
                           unified)
    return PrefillObs(tokens, ctx, ms, decoders, batches, max(1, math.ceil(tokens / ub)), apart,
                      dec_kctx, others_kv if unified else 0.0, narrow,
                      min(ub, riding + min(tokens, n_batch)) >= TILE_ROWS)


def observations(spans: Sequence[Span], server: ServerSettings,
                 span_at: Callable[[float], float] | None = None
                 ) -> tuple[list[PrefillObs], list[DecodeObs]]:
    """The clean prefills and decodes among `spans` (records or server tasks). `span_at`: one
    shared KV's span at a time of the spans' clock, where the server's log places its cells
    (serverobs.kv_span): a decode's slots read it beyond their own cells."""
    index = SpanIndex(spans)
    prefills, decodes = [], []
    for span in spans:
        p0, p1, end = span.prefill_start, span.first_token, span.end
        if p0 is None or p1 is None:
            continue
        computed, prompt_ms = span.prompt_n, span.prompt_ms
        if computed and prompt_ms and not _prefill_beside(index, span, p0, p1):
            obs = prompt_obs(computed, span.cache_n or 0, prompt_ms,
                             _decoding(index, span, p0, p1), server,
                             chained=not server.kv_unified and _below_decoding(index, span, p0, p1))
            if computed >= MIN_PROMPT or is_narrow(obs):
                prefills.append(obs)  # shorter ones: the row-by-row price's (`_fit_narrow`)
        steps = (span.predicted_n or 0) - 1
        if steps >= MIN_STEPS and span.predicted_ms:
            clean = _decode_apart(index, span, p1, end, steps, span.predicted_ms, server)
            if clean is not None:
                beside = _decoding(index, span, p1, end)
                ctx = (span.cache_n or 0) + (computed or 0) + steps / 2
                kv = span_at((p1 + end) / 2) if span_at is not None else 0.0
                decodes.append(DecodeObs(clean[0], clean[1], 1.0 + beside,
                                         ctx * (1.0 + beside) / 1000.0,
                                         max(0.0, kv - ctx) * (1.0 + beside) / 1000.0))
    return prefills, decodes


def _decode_apart(index: SpanIndex, span: Span, t0: float, t1: float, steps: int,
                  decode_ms: float, server: ServerSettings) -> tuple[int, float] | None:
    """A reply's decode steps and mean step time with the other prompts' prefills taken out: the
    time those prefills ran inside its window (their union) and one step per batch of theirs
    (its token rode in each). None when too little of the window, or too few steps, is left: a busy
    day has few replies no prompt ran beside, but most run beside a prompt only part of the time.
    None too beside a prompt fed in pieces (from its first piece: `_computing`): the records do
    not say which of its window's time was pieces and which the steps between them."""
    if t1 <= t0:
        return None
    spans: list[tuple[float, float]] = []
    batches = 0
    for other in index.active(t0, t1, span.key):
        s, e = _computing(other)
        if s is None or e is None or e <= t0 or s >= t1 or e <= s:
            continue
        if other.pieces:
            return None  # its pieces and the pauses between them interleave: neither is known
        a, b = max(s, t0), min(e, t1)
        spans.append((a, b))
        share = (other.prompt_n or 0) * (b - a) / (e - s)
        batches += max(1, math.ceil(share / max(1, server.n_batch)))
    blocked = union_s(spans)
    left_ms = decode_ms - blocked * 1000.0
    left_steps = steps - batches
    if left_steps < MIN_STEPS or left_ms < MIN_CLEAN_SHARE * decode_ms:
        return None
    return left_steps, left_ms / left_steps


def union_s(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def lora_switch_ms(spans: Sequence[Span], costs: Costs, server: ServerSettings) -> float | None:
    """What a change of LoRA settings adds to a prompt computed alone: the median excess over the
    costs' prediction of prompts whose settings differ from the previous prompt's, less that of
    the others (the field report's way: 1,008 against 247 ms). None: under MIN_SWITCHES of either."""
    index = SpanIndex(spans)
    timed = sorted((s for s in spans if s.prefill_start is not None and s.first_token is not None
                    and s.prompt_n and s.prompt_ms is not None), key=lambda s: s.prefill_start or 0)
    excess: dict[bool, list[float]] = {True: [], False: []}
    previous: str | None = None
    for span in timed:
        alone = not any(True for _ in index.active(span.start, span.end, span.key))
        if alone and previous is not None and span.lora is not None:
            predicted = prompt_alone_ms(costs, span.prompt_n or 0, span.cache_n or 0,
                                        n_batch=server.n_batch, n_ubatch=server.n_ubatch,
                                        unified=server.kv_unified)
            excess[span.lora != previous].append((span.prompt_ms or 0.0) - predicted)
        previous = span.lora if span.lora is not None else previous
    if min(len(excess[True]), len(excess[False])) < MIN_SWITCHES:
        return None
    return max(0.0, float(np.median(excess[True])) - float(np.median(excess[False])))


def is_narrow(obs: PrefillObs) -> bool:
    """A prompt computed in one micro-batch under TILE_ROWS rows, after enough context to tell the
    row-by-row price (a shorter one stays with the tiled fit: its fixed part is most of it)."""
    return obs.micro == 1 and obs.batches == 1 and obs.narrow >= MIN_KCELLS


def _computing(span: Span) -> tuple[float | None, float | None]:
    """When the server computed the span's prompt: from its first piece (slotwise's `chunk` fed
    the rest of its wait in pieces) or its prefill, to its first token. A span with no prefill
    start (it never reached the server) computed nothing, pieces or not."""
    if span.prefill_start is None:
        return None, span.first_token
    return span.compute_start, span.first_token


def _prefill_beside(index: SpanIndex, span: Span, t0: float, t1: float) -> bool:
    for other in index.active(t0, t1, span.key):
        s, e = _computing(other)
        if s is not None and e is not None and s < t1 and e > t0:
            return True
    return False


def _below_decoding(index: SpanIndex, span: Span, t0: float, t1: float) -> bool:
    """The slot just below `span`'s decoding when its prompt started (a KV per slot: its first
    token then goes with that decode token, `stepcost.PromptRun.chained`)."""
    if span.slot is None or span.slot < 1:
        return False
    return any(other.slot == span.slot - 1 and other.first_token is not None
               and other.first_token <= t0 < other.end
               for other in index.active(t0, t1, span.key))


def _decoding(index: SpanIndex, span: Span, t0: float, t1: float) -> float:
    """Other spans decoding during (t0, t1), on average."""
    if t1 <= t0:
        return 0.0
    total = 0.0
    for other in index.active(t0, t1, span.key):
        if other.first_token is not None:
            total += max(0.0, min(t1, other.end) - max(t0, other.first_token))
    return total / (t1 - t0)
