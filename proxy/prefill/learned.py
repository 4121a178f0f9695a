"""What slotwise learned of its llama-server, kept across slotwise's own restarts
(`prefill.learned_file`): the batch cost's samples (rule 9), the row-by-row price's (rule 19) and
how much of a held reply follow-ups find (estimate/replies.py). After a restart the first cold
prompts are then paced by what the server was measured to cost, not by the prior, and the first
short follow-ups are trimmed where the price learned before says so (a fresh start needs three
such turns computed row by row first).

Each is kept with the server it was measured on (`ServerKey`: its model file, llama.cpp build,
slots, slot context, and slotwise's `n_batch`); another server starts afresh. A machine that
changed under the same server is found by the batch cost's shift (its older samples dropped, the
row-by-row price learned again). Pure: to and from a JSON value, checked field by field; the file
is read and written by `learned_file.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from proxy.prefill.batch_cost import Row, batch_row
from proxy.prefill.layout import ServerLayout

VERSION = 1
ROW_TERMS = len(batch_row(1, 0))
MAX_ITEMS = 1024
"""More entries than this in a list is not a file slotwise wrote."""


class LearnedError(ValueError):
    """The file is not what slotwise writes: says where and what."""


@dataclass(frozen=True)
class ServerKey:
    """The server what was learned holds for."""

    model: str
    build: str
    slots: int
    slot_ctx: int
    n_batch: int

    @classmethod
    def of(cls, layout: ServerLayout, n_batch: int) -> ServerKey | None:
        """None until `/props` told the model and the slots."""
        if layout.model is None or layout.slots is None or layout.slot_ctx is None:
            return None
        return cls(layout.model, layout.build or "", layout.slots, layout.slot_ctx, n_batch)

    def change(self, kept: Any) -> str | None:
        """What differs in the server `kept` (a file's `server`) from this one; None: nothing."""
        if not isinstance(kept, Mapping):
            return "no server recorded"
        for f in fields(self):
            if kept.get(f.name) != getattr(self, f.name):
                return f"{f.name} was {kept.get(f.name)!r}, now {getattr(self, f.name)!r}"
        return None


@dataclass(frozen=True)
class Learned:
    batches: list[tuple[Row, float, float]]
    """The batch cost's samples: row, time (ms), the scale its error counts relative to."""
    narrow: list[float]
    """The row-by-row price's samples (ms a row per 1,000 tokens of context)."""
    replies: list[tuple[float, bool]]
    """Follow-ups' share of a held reply found, and whether whole."""

    @property
    def empty(self) -> bool:
        return not (self.batches or self.narrow or self.replies)

    def summary(self) -> str:
        return (f"{len(self.batches)} batch-cost samples, {len(self.narrow)} row-by-row prices, "
                f"{len(self.replies)} follow-ups")


def dump(key: ServerKey, learned: Learned) -> dict[str, Any]:
    """The JSON value `parse` reads back."""
    return {
        "version": VERSION,
        "server": asdict(key),
        "batch_cost": [[*row, ms, scale] for row, ms, scale in learned.batches],
        "row_by_row_ms": list(learned.narrow),
        "replies": [[share, whole] for share, whole in learned.replies],
    }


def parse(data: Any, key: ServerKey) -> tuple[Learned | None, str | None]:
    """What a file holds for `key`, or (None, why not) when it was learned on another server.
    Raises LearnedError for anything slotwise does not write."""
    if not isinstance(data, Mapping):
        raise LearnedError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("version") != VERSION:
        raise LearnedError(f"version: expected {VERSION}, got {data.get('version')!r}")
    change = key.change(data.get("server"))
    if change is not None:
        return None, f"another server ({change})"
    batches = [_batch(item, f"batch_cost[{i}]")
               for i, item in enumerate(_list(data, "batch_cost"))]
    narrow = [_finite(item, f"row_by_row_ms[{i}]")  # a sample may be below the tiled price
              for i, item in enumerate(_list(data, "row_by_row_ms"))]
    replies = [_reply(item, f"replies[{i}]") for i, item in enumerate(_list(data, "replies"))]
    return Learned(batches, narrow, replies), None


def _list(data: Mapping[str, Any], name: str) -> Sequence[Any]:
    value = data.get(name, [])
    if not isinstance(value, list):
        raise LearnedError(f"{name}: expected a list, got {type(value).__name__}")
    if len(value) > MAX_ITEMS:
        raise LearnedError(f"{name}: {len(value)} entries, at most {MAX_ITEMS}")
    return value


def _finite(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LearnedError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _number(value: Any, where: str, positive: bool = False) -> float:
    value = _finite(value, where)
    if value < 0 or (positive and value <= 0):
        raise LearnedError(f"{where}: expected a {'positive' if positive else 'non-negative'} "
                           f"number, got {value!r}")
    return float(value)


def _batch(item: Any, where: str) -> tuple[Row, float, float]:
    if not isinstance(item, list) or len(item) != ROW_TERMS + 2:
        raise LearnedError(f"{where}: expected [{ROW_TERMS} row terms, ms, scale], got {item!r}")
    values = [_number(v, f"{where}[{i}]") for i, v in enumerate(item)]
    row: Row = tuple(values[:ROW_TERMS])  # type: ignore[assignment]
    ms, scale = (_number(v, where, positive=True) for v in values[ROW_TERMS:])
    return row, ms, scale


def _reply(item: Any, where: str) -> tuple[float, bool]:
    if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], bool)
            or _number(item[0], where) > 1):
        raise LearnedError(f"{where}: expected [share found 0-1, found whole], got {item!r}")
    return float(item[0]), item[1]
