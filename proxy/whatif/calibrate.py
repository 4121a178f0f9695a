"""The server model's costs, fitted from what a day's log shows (observe.py), in the prefill gate's
batch-cost form.

Prefill: every prompt of at least MIN_PROMPT tokens computed while no other prompt was (its prefill
time, its cached prefix, the decoding slots beside it on average), or with llama-server's log every
task's own prompt time and every step of its prompt-progress lines (serverobs.py), each one
observation of the batch cost's coefficients; fitted by non-negative least squares on the time
relative to its square root, the prior's shapes at 3 % keeping what the day cannot tell apart at
the prior's proportions. Decode, fitted first: with llama-server's log the steps between its
generation-progress lines; else every reply of at least MIN_STEPS tokens, its mean step with the
other prompts computed in its window taken out (their time and one step per batch of theirs),
against the slots generating beside it and the context they attend to. A LoRA
switch: what prompts computed alone after other LoRA settings take over the prediction.
A coefficient the observations cannot tell (no decoding slot beside a prefill, one context size)
keeps its default and is reported as assumed. Pure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from proxy.prefill.batch_cost import PRIOR, PRIOR_SHAPES, batch_row
from proxy.prefill.narrow import MIN_SAMPLES
from proxy.prefill.nnls import nonnegative_lstsq
from proxy.prefill.sizing import TILE_ROWS
from proxy.whatif.costs import Costs
from proxy.whatif.observe import DecodeObs, PrefillObs, is_narrow, prompt_obs
from proxy.whatif.settings import ServerSettings

PRIOR_SHARE = 0.03
MIN_CTX_SPREAD = 2000
"""Contexts must differ by this many tokens before the fit may put a price on context."""
SCAN_SHARE = 0.009
"""Where the log cannot tell `decode_per_kv_ms`, this share of the step per 1,000 cells: on the
testbed three streams' steps in a span of ~17,400 cells took 16.5 ms against 11.3 ms in one of a
few hundred (`bench contention --scenario field`, direct: 0.0090), and 1.31-1.37× beside a
12,309-token prompt held in another slot (`bench kv`: ~0.0085)."""


@dataclass
class Calibration:
    costs: Costs
    prefills: int = 0
    steps: int = 0
    decodes: int = 0
    narrow: int = 0
    """Prompts the row-by-row price was fitted from."""
    notes: list[str] = field(default_factory=list)


def fit(prefills: Sequence[PrefillObs], decodes: Sequence[DecodeObs], n_ubatch: int,
        base: Costs | None = None, given: Collection[str] = ()) -> Calibration:
    """Costs fitted to the observations; what they cannot tell stays at `base` (assumed), and so
    do the decode terms `given` (their field names): the other decode terms are fitted around
    them."""
    costs = base if base is not None else Costs()
    cal = Calibration(costs, prefills=len(prefills), decodes=len(decodes))
    if decodes:
        cal.costs = _fit_decode(cal, decodes, given)
    else:
        cal.notes.append("decode: no reply of 16+ tokens generated mostly without a prompt beside it: "
                         "its costs are assumed")
    narrow = [o for o in prefills if is_narrow(o)]
    tiled = [o for o in prefills if not is_narrow(o)]
    if tiled:
        cal.costs = _fit_prefill(cal, tiled, n_ubatch)
    else:
        cal.notes.append("prefill: no prompt of 256+ tokens computed alone in the log: its costs "
                         "are assumed (give them with --costs)")
    if "narrow_per_row_kctx_ms" not in given:
        cal.costs = _fit_narrow(cal, narrow, n_ubatch)
    if not any(o.decoders > 0 for o in prefills):
        cal.costs = cal.costs.with_values({"per_decoder_ms": cal.costs.per_slot_ms}, "assumed")
        cal.notes.append("prefill.per_decoder_ms: no prefill had a decoding slot beside it; taken "
                         "as decode.per_slot_ms")
    return cal


def _prior_ms(row: Sequence[float]) -> float:
    """The prefill policy's prior on this model's first five features (its own two, the other
    slots' cells, are the prior's zeros)."""
    a, b, c, e, g = row[:5]
    return PRIOR.time_ms((a, b, c, e, g, 0.0, 0.0))


def _fit_prefill(cal: Calibration, obs: Sequence[PrefillObs], n_ubatch: int) -> Costs:
    """The decode tokens' attention beside each prompt is the decode fit's (the server model adds
    it to every batch they ride in), so it is taken out of the times first. A decode token in a
    prompt's batch is one more row of its matmuls (`per_decoder_ms` = `per_token_ms`); what it
    costs beyond that comes from the cells it attends to (`per_decoder_kctx_ms`, one shared KV):
    fitting both, a day whose batches always had two decoders beside them cannot tell them apart.
    The cells are priced within `CELL_BOUNDS` of the context's own (`_bounded_fit`)."""
    rows = [o.row(n_ubatch) for o in obs]
    per_kctx = cal.costs.decode_per_kctx_ms
    ys = [max(0.05 * o.ms, o.ms - per_kctx * o.dec_kctx * o.batches) for o in obs]
    level = float(np.median([y / max(1e-9, _prior_ms(r)) for y, r in zip(ys, rows, strict=True)]))
    prior = [(*batch_row(*shape)[:5], 0.0, 0.0) for shape in PRIOR_SHAPES]
    y = np.array(ys + [level * _prior_ms(r) for r in prior], dtype=np.float64)
    a = np.array(rows + prior, dtype=np.float64)
    a[:, 1] += a[:, 3]  # a decoder's token is a token of the batch's matmuls
    a = a[:, [0, 1, 2, 4, 5, 6]]
    # errors relative to the square root of the time: a 20 s prefill weighs five times a 0.8 s one
    w = np.array([1.0] * len(rows) + [PRIOR_SHARE] * len(prior)) / np.sqrt(np.maximum(y, 1e-9))
    read_told = tells_read(obs, n_ubatch)
    fa, fb, fc, fg, fs, fp = _bounded_fit(a * w[:, None], y * w,
                                          {} if read_told else {3: float(TILE_ROWS)})
    found = {"fixed_ms": fa, "per_token_ms": fb}
    if any(o.decoders > 0 for o in obs):
        found["per_decoder_ms"] = fb
    spread = max(o.ctx for o in obs) - min(o.ctx for o in obs)
    if spread < MIN_CTX_SPREAD and max(o.tokens for o in obs) < MIN_CTX_SPREAD:
        cal.notes.append("prefill: every prompt had about the same context: no price on context "
                         "or cells (per_token_per_kctx_ms, per_kctx_ms, per_decoder_kctx_ms, "
                         "per_token_per_kv_ms assumed)")
        return cal.costs.with_values(found, "log")
    found.update(per_token_per_kctx_ms=fc, per_kctx_ms=fg)
    if not read_told:
        cal.notes.append(f"prefill.per_kctx_ms: no prompt computed in micro-batches of at most "
                         f"{n_ubatch // 2} rows after {MIN_CTX_SPREAD:,}+ tokens of context: the "
                         f"context read taken as {TILE_ROWS} × the context's price per token (a "
                         "query tile's rows; whole prompts cannot tell the two apart)")
    if any(r[5] > 0 for r in rows):
        found["per_decoder_kctx_ms"] = fs
    if any(r[6] > 0 for r in rows):
        found["per_token_per_kv_ms"] = fp
    return cal.costs.with_values(found, "log")


def tiled_ms(costs: Costs, obs: PrefillObs, n_ubatch: int) -> float:
    """What `costs` price the observation at in the batch cost's tiled form (its micro-batches'
    terms, the decode tokens' attention beside it): the fit's own prediction."""
    a, b, c, e, g, s, p = obs.row(n_ubatch)
    return (costs.fixed_ms * a + costs.per_token_ms * b + costs.per_token_per_kctx_ms * c
            + costs.per_decoder_ms * e + costs.per_kctx_ms * g + costs.per_decoder_kctx_ms * s
            + costs.per_token_per_kv_ms * p + costs.decode_per_kctx_ms * obs.dec_kctx * obs.batches)



def _fit_narrow(cal: Calibration, usable: Sequence[PrefillObs], n_ubatch: int) -> Costs:
    """The row-by-row price (`narrow_per_row_kctx_ms`): the median of what each prompt computed
    in one micro-batch under TILE_ROWS rows (`_narrow`) took beyond its tiled price, per thousand
    cells its tokens attended to. A day of follow-up turns has many (`bench day`: 47-58 new
    tokens after 1,100-6,600 cached); a server with no such path prices them at about zero."""
    if len(usable) < MIN_SAMPLES:
        cal.notes.append(f"prefill.narrow_per_row_kctx_ms: under {MIN_SAMPLES} prompts computed in "
                         f"one micro-batch of under {TILE_ROWS} rows after a long context: a "
                         "micro-batch of fewer rows is priced as a tiled one (ggml's CPU flash "
                         "attention computes it row by row; `slotwise bench pieces --sizes "
                         "16,32,48` measures it)")
        return cal.costs
    excess = [(o.ms - tiled_ms(cal.costs, o, n_ubatch)) / o.narrow for o in usable]
    cal.narrow = len(usable)
    return cal.costs.with_values({"narrow_per_row_kctx_ms": max(0.0, float(np.median(excess)))},
                                 "log")


CELL_BOUNDS = {4: TILE_ROWS, 5: 1.0}
"""The fit's columns (`_fit_prefill`: fixed, token, context, context read, decoder cells, other
slots' cells) priced at most a multiple of a prompt token's own context (column 2): a decode token
riding in a prompt's micro-batch pays its cells at a query tile's price (`TILE_ROWS` rows), and a
cell the mask hides costs a token at most what one it attends to does (the attention skips it)."""


def tells_read(obs: Sequence[PrefillObs], n_ubatch: int) -> bool:
    """Whether the prompts tell the context read (g, once per micro-batch) from the context's price
    per token (c): some prompt went in micro-batches of at most half `n_ubatch` rows after
    MIN_CTX_SPREAD tokens of context. A day's whole prompts go in micro-batches of `n_ubatch`,
    where g costs what c does at `n_ubatch` × the ratio, one for the other (a direct `bench day`
    fitted g at 0); its turns of under TILE_ROWS new tokens go row by row (`_narrow`), and a
    follow-up of 64-256 after 2,000 cached does tell. Where they cannot, `_fit_prefill`
    ties g at TILE_ROWS × c: a micro-batch reads its context as if for one query tile's rows at
    least. `bench day`'s slotwise days, fed in pieces of 64-384 tokens, fit g at 47-136 × c on
    their own (eighteenth sitting); at 64 × c the recommended layout's `chunk` day's pieces (64-384
    tokens after 0-5,900 of context) are priced within 7 %, where g = 0 put them 35-50 % low."""
    half = max(1, n_ubatch // 2)
    return any(o.tokens <= half * o.micro and o.ctx >= MIN_CTX_SPREAD for o in obs)


def _bounded_fit(a: np.ndarray, y: np.ndarray,
                 tied: dict[int, float] | None = None) -> tuple[float, ...]:
    """Non-negative least squares under `CELL_BOUNDS`: a column fitted past its bound is tied to it
    (its column folded into the context's at that multiple) and the rest fitted again. Unbounded,
    a day whose short prompts were slow for another reason put it on the few hundred cells the
    other slots held (2.9 ms a token per 1,000 against 0.52 for its own context, on a `bench
    contention --scenario field` day), and then on the decoders' cells (76 ms per 1,000).
    `tied`: columns tied from the start (column: multiple)."""
    tied = dict(tied or {})
    x = _tied_fit(a, y, tied)
    while over := {c: k for c, k in CELL_BOUNDS.items() if c not in tied and x[c] > k * x[2]}:
        tied.update(over)
        x = _tied_fit(a, y, tied)
    return tuple(float(v) for v in x)


def _tied_fit(a: np.ndarray, y: np.ndarray, tied: dict[int, float]) -> np.ndarray:
    """Non-negative least squares with each `tied` column priced at its multiple of column 2's."""
    folded = a.copy()
    for c, k in tied.items():
        folded[:, 2] += k * a[:, c]
    free = [c for c in range(a.shape[1]) if c not in tied]
    x = np.zeros(a.shape[1])
    x[free] = nonnegative_lstsq(folded[:, free], y)
    for c, k in tied.items():
        x[c] = k * x[2]
    return x


def _fit_decode(cal: Calibration, obs: Sequence[DecodeObs],
                given: Collection[str] = ()) -> Costs:
    """The step, and the price of each other slot and of context where the observations vary in
    them enough to tell; a term they cannot tell, or `given` (`--costs`), keeps its value and is
    taken out of the times first (else the step's constant would be split with it at random)."""
    base = cal.costs
    features: dict[str, Callable[[DecodeObs], float]] = {
        "step_ms": lambda o: 1.0,
        "per_slot_ms": lambda o: max(0.0, o.slots - 1.0),
        "decode_per_kctx_ms": lambda o: o.kctx,
        "decode_per_kv_ms": lambda o: o.scanned,
    }
    tells = {
        "step_ms": True,
        "per_slot_ms": max(o.slots for o in obs) - min(o.slots for o in obs) >= 0.5,
        "decode_per_kctx_ms": (max(o.kctx for o in obs) - min(o.kctx for o in obs)
                               >= MIN_CTX_SPREAD / 1000.0),
        "decode_per_kv_ms": (max(o.scanned / o.slots for o in obs)
                             - min(o.scanned / o.slots for o in obs) >= MIN_CTX_SPREAD / 1000.0),
    }
    if not tells["per_slot_ms"]:
        cal.notes.append(f"decode: about as many slots generating in every decode window "
                         f"({_span(o.slots for o in obs)}): per_slot_ms assumed")
    # the span known (a server log, one shared KV) but not told apart: its share of the step
    tied = not tells["decode_per_kv_ms"] and any(o.scanned > 0 for o in obs) \
        and "decode_per_kv_ms" not in given and "step_ms" not in given
    if tied:
        features["step_ms"] = lambda o: 1.0 + SCAN_SHARE * o.scanned
        cal.notes.append(f"decode: about as many cells of the shared KV's span beyond a decode "
                         f"token's own in every decode window "
                         f"({_span(o.scanned / o.slots for o in obs)}k): "
                         f"per_kv_ms assumed at {SCAN_SHARE:g} of the step per 1,000")
    fitted = [k for k, tell in tells.items() if tell and k not in given]
    kept = [k for k in features if k not in fitted and not (tied and k == "decode_per_kv_ms")]
    cal.steps = sum(o.steps for o in obs)
    if not fitted:
        return base
    rows = np.array([[features[k](o) for k in fitted] for o in obs], dtype=np.float64)
    y = np.array([o.step_ms - sum(getattr(base, k) * features[k](o) for k in kept) for o in obs],
                 dtype=np.float64)
    w = np.sqrt(np.array([o.steps for o in obs], dtype=np.float64))
    found = dict(zip(fitted, (float(v) for v in nonnegative_lstsq(rows * w[:, None], y * w)),
                     strict=True))
    if found.get("step_ms") == 0.0:
        cal.notes.append(
            f"decode.step_ms: fitted 0 ms: the log's decode windows ({_span(o.slots for o in obs)} "
            f"slots generating, {_span(o.kctx for o in obs)}k cells) put a step's whole time on "
            "its slots and context, so a short stream generating alone is priced too fast; give "
            "decode.step_ms with --costs (the predicted_per_token_ms of a short request sent alone) "
            "and the rest is fitted around it")
    costs = base.with_values(found, "log")
    if tied:
        costs = costs.with_values({"decode_per_kv_ms": SCAN_SHARE * costs.step_ms}, "assumed")
    return costs


def _span(values: Iterable[float]) -> str:
    ordered = sorted(values)
    low, high = f"{ordered[0]:.3g}", f"{ordered[-1]:.3g}"
    return low if low == high else f"{low}-{high}"


def fit_rates(rates: Iterable[tuple[int, float]], decode_tok_s: float | None,
              server: ServerSettings, base: Costs) -> Costs:
    """Costs from figures like the field report's: prompt tokens/s by the tokens a batch advanced
    (`[measured] prefill_rates`), one stream's decode rate; fitted in the same form."""
    one = dataclasses.replace(server, n_batch=1 << 30)  # each row is one batch
    obs = [prompt_obs(n, 0, n / r * 1000.0, 0.0, one) for n, r in rates]
    costs = base
    if decode_tok_s:
        step = 1000.0 / decode_tok_s
        costs = costs.with_values({"step_ms": step}, "measured")
        obs.append(prompt_obs(1, 0, step, 0.0, one))
    if len(obs) >= 2:
        a = np.array([o.row(server.n_ubatch)[:2] for o in obs], dtype=np.float64)
        y = np.array([o.ms for o in obs], dtype=np.float64)
        fixed, per_token = (float(v) for v in nonnegative_lstsq(a, y))
        costs = costs.with_values({"fixed_ms": fixed, "per_token_ms": per_token}, "measured")
    return costs
