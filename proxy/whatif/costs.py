"""What the server model's time is made of: the costs of a batch, a decode step, a LoRA switch and
a copy to or from the RAM prompt cache, each with where it came from (given in `--costs`,
calibrated from the log, read from the model file, or assumed), and the `--costs FILE` format that gives them.

A batch with prompt tokens costs, per micro-batch of `n_ubatch` tokens, the prefill gate's own
form (`proxy/prefill/batch_cost.py`): a + g·ctx/1000 + b·n + c·n·(ctx + n/2)/1000, plus e per
decoding slot's token riding in it; with one shared KV also p·n·(the span's other cells)/1000 and
s·(the decoding slots' cells)/1000 (stepcost.py says why); a micro-batch of fewer than 64 rows
also r·(the cells its prompt tokens attend to, all together)/1000 (ggml's CPU attention computes
it row by row). A batch of decode tokens only costs one step: step + per_slot·(slots − 1) +
per_kctx·(cells the decode tokens attend to)/1000, each its own slot's, + per_kv·(cells of the
span each scans beyond its own)/1000 with one shared KV (kvcells.py).
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from proxy.prefill.batch_cost import BatchCost


class CostsError(ValueError):
    """A costs file the what-if cannot use; the message names the key."""


@dataclass(frozen=True)
class Costs:
    fixed_ms: float = 20.0
    """prefill.fixed_ms: a, per micro-batch with prompt tokens."""
    per_token_ms: float = 2.0
    """prefill.per_token_ms: b, per prompt token."""
    per_token_per_kctx_ms: float = 0.0
    """prefill.per_token_per_kctx_ms: c, per prompt token per 1,000 tokens it attends to."""
    per_decoder_ms: float = 1.0
    """prefill.per_decoder_ms: e, per decoding slot's token in a batch with prompt tokens."""
    per_kctx_ms: float = 0.0
    """prefill.per_kctx_ms: g, per micro-batch per 1,000 tokens of context it reads."""
    per_decoder_kctx_ms: float = 0.0
    """prefill.per_decoder_kctx_ms: with one shared KV, per 1,000 cells the decoding slots' tokens
    attend to, in a batch with prompt tokens: they share the prompt's micro-batch, and ggml's CPU
    flash attention computes a 64-row tile of queries over every cell one of its rows sees, so a
    decode token there costs its cells at 64 rows' price (ggml-cpu/ops.cpp, flash_attn_ext_tiled)."""
    per_token_per_kv_ms: float = 0.0
    """prefill.per_token_per_kv_ms: with one shared KV, per prompt token per 1,000 cells of the
    span beyond its own (kvcells.py): ggml's CPU flash attention reads the mask of every cell up to
    the highest in use for each tile of queries, the cells it then skips too (ggml-cpu/ops.cpp,
    flash_attn_ext_tiled)."""
    narrow_per_row_kctx_ms: float = 0.0
    """prefill.narrow_per_row_kctx_ms: a micro-batch of fewer than TILE_ROWS rows is computed by
    ggml's CPU flash attention one row at a time, each row reading its own context: per prompt
    token in one, per 1,000 tokens it attends to, beyond the tiled price (`slotwise bench pieces`
    on the testbed: ~4.8 ms; none where the server has no such path)."""
    step_ms: float = 20.0
    """decode.step_ms: a batch of one decode token."""
    per_slot_ms: float = 1.0
    """decode.per_slot_ms: each further decoding slot in the step."""
    decode_per_kctx_ms: float = 0.0
    """decode.per_kctx_ms: per decode token per 1,000 tokens it attends to."""
    decode_per_kv_ms: float = 0.0
    """decode.per_kv_ms: with one shared KV, per decode token per 1,000 cells of the span its
    attention runs over (kvcells.py) that are not its own slot's: hidden by the mask, still read.
    Where the log cannot tell it, `SCAN_SHARE` of the step (calibrate.py)."""
    lora_switch_ms: float = 0.0
    """server.lora_switch_ms: a batch whose LoRA settings differ from the last one's
    (sched_reserve)."""
    kv_bytes_per_token: float = 131072.0
    """server.kv_bytes_per_token: one token's KV, for the RAM prompt cache's size limit and copies
    (the log's kept files measure it, else the model file: modelfile.py)."""
    save_gb_s: float = 10.0
    """server.save_gb_s: copies of a slot's prompt into the RAM prompt cache (on the main loop: all
    wait); the log's slot switches time them (copies.py): 0.5-1.6 GB/s on the testbed."""
    copy_gb_s: float = 10.0
    """server.copy_gb_s: copies of a cached prompt back into a slot (on the main loop: all wait):
    into memory in use, 6,877 tokens in ~27 ms on the testbed (~6 GB/s)."""
    piece_ms: float = 5.0
    """server.piece_ms: a piece's round trip outside the server's batches (HTTP, parsing)."""
    source: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Each field's origin: given, log, model file, field table, or assumed (missing: assumed)."""

    @property
    def batch(self) -> BatchCost:
        return BatchCost(self.fixed_ms, self.per_token_ms, self.per_token_per_kctx_ms,
                         self.per_decoder_ms, self.per_kctx_ms)

    def origin(self, name: str) -> str:
        return self.source.get(name, "assumed")

    def assumed(self) -> list[str]:
        return [key_of(f.name) for f in fields(self) if f.name != "source"
                and self.origin(f.name) == "assumed"]

    def with_values(self, values: Mapping[str, float], origin: str) -> Costs:
        """These fields set (by field name), marked as coming from `origin`."""
        if not values:
            return self
        return replace(self, **values, source={**self.source, **dict.fromkeys(values, origin)})

    def as_toml(self) -> str:
        """A `--costs` file holding these costs (each line says where its value came from)."""
        lines: list[str] = []
        for table in ("prefill", "decode", "server"):
            lines.append(f"[{table}]")
            for key, name in KEYS.items():
                if key.startswith(table + "."):
                    value = getattr(self, name)
                    lines.append(f"{key.split('.', 1)[1]} = {value:.6g}  # {self.origin(name)}")
            lines.append("")
        return "\n".join(lines)


KEYS: dict[str, str] = {
    "prefill.fixed_ms": "fixed_ms",
    "prefill.per_token_ms": "per_token_ms",
    "prefill.per_token_per_kctx_ms": "per_token_per_kctx_ms",
    "prefill.per_decoder_ms": "per_decoder_ms",
    "prefill.per_kctx_ms": "per_kctx_ms",
    "prefill.per_decoder_kctx_ms": "per_decoder_kctx_ms",
    "prefill.per_token_per_kv_ms": "per_token_per_kv_ms",
    "prefill.narrow_per_row_kctx_ms": "narrow_per_row_kctx_ms",
    "decode.step_ms": "step_ms",
    "decode.per_slot_ms": "per_slot_ms",
    "decode.per_kctx_ms": "decode_per_kctx_ms",
    "decode.per_kv_ms": "decode_per_kv_ms",
    "server.lora_switch_ms": "lora_switch_ms",
    "server.kv_bytes_per_token": "kv_bytes_per_token",
    "server.save_gb_s": "save_gb_s",
    "server.copy_gb_s": "copy_gb_s",
    "server.piece_ms": "piece_ms",
}
MEASURED = ("prefill_rates", "decode_tok_s", "pieces")
"""[measured]: figures to fit costs from, as the field report gives them: `prefill_rates` rows of
[tokens a batch advanced, prompt tokens/s], and `decode_tok_s` of one stream alone; or as
`slotwise bench pieces --costs-out` measures them: `pieces` rows of [tokens, tokens cached before,
prompt_ms, slots decoding meanwhile], each one batch, fitted together with the log's prompts."""


def key_of(name: str) -> str:
    return next(k for k, v in KEYS.items() if v == name)


@dataclass(frozen=True)
class CostsFile:
    values: dict[str, float]
    """Field name → value, for the keys given."""
    prefill_rates: tuple[tuple[int, float], ...] = ()
    decode_tok_s: float | None = None
    pieces: tuple[MeasuredPiece, ...] = ()


@dataclass(frozen=True)
class MeasuredPiece:
    """One batch of a fed prompt measured on the server (`slotwise bench pieces`)."""

    tokens: int
    prefix: int
    """Tokens cached before it."""
    prompt_ms: float
    decoders: int
    """Slots decoding a token in the same batch."""


def load_costs(path: str) -> CostsFile:
    """A TOML (or JSON) file of tables prefill, decode, server and measured."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CostsError(f"{path}: cannot read the costs file: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise CostsError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'TOML'}: "
                         f"{exc}") from None
    return parse_costs(data)


def parse_costs(data: Mapping[str, Any]) -> CostsFile:
    values: dict[str, float] = {}
    for table, body in data.items():
        if table not in ("prefill", "decode", "server", "measured"):
            raise CostsError(f"{table}: unknown table (valid: prefill, decode, server, measured)")
        if not isinstance(body, Mapping):
            raise CostsError(f"{table}: expected a table")
        if table == "measured":
            continue
        for key, value in body.items():
            dotted = f"{table}.{key}"
            if dotted not in KEYS:
                valid = ", ".join(k.split(".", 1)[1] for k in KEYS if k.startswith(table + "."))
                raise CostsError(f"{dotted}: unknown key (valid: {valid})")
            values[KEYS[dotted]] = _number(dotted, value)
    return CostsFile(values, *_measured(data.get("measured", {})))


def _measured(body: Mapping[str, Any]
              ) -> tuple[tuple[tuple[int, float], ...], float | None, tuple[MeasuredPiece, ...]]:
    """(prefill_rates, decode_tok_s, pieces) of the [measured] table."""
    for key in body:
        if key not in MEASURED:
            raise CostsError(f"measured.{key}: unknown key (valid: {', '.join(MEASURED)})")
    rates = tuple((int(n), r) for n, r in _rows(
        body, "prefill_rates", (True, False),
        "[tokens, tokens_per_s], e.g. [[2048, 845], [400, 719]]"))
    if any(n < 1 or r <= 0 for n, r in rates):
        raise CostsError("measured.prefill_rates: tokens and rates must be above 0")
    pieces = tuple(MeasuredPiece(int(n), int(x), ms, int(d)) for n, x, ms, d in _rows(
        body, "pieces", (True, True, False, True),
        "[tokens, tokens cached before, prompt_ms, slots decoding], e.g. [[64, 3000, 212.5, 3]]"))
    if any(p.tokens < 1 or p.prompt_ms <= 0 for p in pieces):
        raise CostsError("measured.pieces: tokens and prompt_ms must be above 0")
    decode = body.get("decode_tok_s")
    return rates, None if decode is None else _number("measured.decode_tok_s", decode), pieces


def _rows(body: Mapping[str, Any], key: str, whole: tuple[bool, ...], shape: str
          ) -> list[tuple[float, ...]]:
    """The rows of `measured.KEY`, each of `len(whole)` numbers >= 0, those marked whole counts."""
    dotted = f"measured.{key}"
    rows = body.get(key, [])
    if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) == len(whole) for r in rows):
        raise CostsError(f"{dotted}: expected rows {shape}")
    out = []
    for i, row in enumerate(rows, 1):
        values = tuple(_number(f"{dotted} row {i}", v) for v in row)
        if any(w and not v.is_integer() for w, v in zip(whole, values, strict=True)):
            raise CostsError(f"{dotted} row {i}: expected whole numbers of tokens and slots, "
                             f"got {row!r}")
        out.append(values)
    return out


def _number(dotted: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise CostsError(f"{dotted}: expected a number >= 0, got {value!r}")
    return float(value)
