"""The values that flow from parsers to aggregation to rendering.

`Span` is one request (timing record) or one server task placed on a time axis in seconds;
`Table` and `Row` are what aggregation returns and renderers format. No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Segment:
    """A stretch of one span's decode and the token rate measured in it."""

    start: float
    end: float
    rate: float
    why: str = ""


@dataclass(frozen=True)
class Span:
    """One request or server task on the time axis (seconds); None = not measured."""

    key: str
    start: float
    end: float
    kind: str | None = None
    """The record's `kind` (`chat`, `warm`, `kv_save`, …); None for a server task."""
    prefill_start: float | None = None
    first_token: float | None = None
    prompt_n: int | None = None
    """Prompt tokens the server computed for the request itself (cache excluded)."""
    cache_n: int | None = None
    """Prompt tokens the server reused from its cache (pieces fed ahead included)."""
    fed_n: int = 0
    """Prompt tokens computed ahead of the request, in pieces fed by slotwise's `chunk` policy."""
    pieces: int = 0
    """How many such pieces (their computation started some time between arrival and prefill)."""
    first_piece: float | None = None
    """When the first piece began, if other records' overlaps tell; else None."""
    predicted_n: int | None = None
    prompt_ms: float | None = None
    predicted_ms: float | None = None
    slot: int | None = None
    client: str | None = None
    purpose: str | None = None
    lora: str | None = None
    """Canonical text of the LoRA settings forwarded; None when unknown."""
    running_at_start: tuple[str, ...] | None = None
    """Keys of the spans in flight when this one arrived; None = derive from the time axis."""
    longest_gap_start: float | None = None
    """When a stream's longest gap between token events began (its record's `gap_max_at_ms`);
    None with fewer than two token events, or in a log written before the field."""
    longest_gap_s: float | None = None
    """How long that gap lasted (`gap_max_ms`): known also where its start is not."""
    segments: tuple[Segment, ...] = ()
    info: tuple[tuple[str, str], ...] = ()
    """Extra figures shown when hovering this span in a timeline."""

    @property
    def new_n(self) -> int | None:
        """The prompt tokens computed for this turn: by the request itself plus its pieces."""
        return None if self.prompt_n is None else self.prompt_n + self.fed_n

    @property
    def cached_n(self) -> int | None:
        """The prompt tokens that were in the cache before the turn arrived (its pieces excluded)."""
        return None if self.cache_n is None else max(0, self.cache_n - self.fed_n)

    @property
    def compute_start(self) -> float:
        """When the server began computing this prompt: its first piece, else its prefill. A
        turn fed in pieces whose first piece is unknown counts from its arrival."""
        if self.pieces:
            return self.first_piece if self.first_piece is not None else self.start
        return self.prefill_start if self.prefill_start is not None else self.start

    @property
    def compute_end(self) -> float:
        """When the server was done computing this prompt: the first token, else the span's end."""
        return self.first_token if self.first_token is not None else self.end

    @property
    def total_s(self) -> float:
        return self.end - self.start

    @property
    def wait_s(self) -> float | None:
        return None if self.prefill_start is None else max(0.0, self.prefill_start - self.start)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def prefill_end(self) -> float | None:
        return self.first_token


@dataclass(frozen=True)
class Row:
    """One line of a table: a label, its sample count, and one value per stat column."""

    label: str
    n: int
    values: tuple[float | None, ...]
    unit: str | None = None
    """The unit of every value of this row, instead of the table's `units` (a table of unlike
    figures, such as the overview)."""


@dataclass(frozen=True)
class Table:
    """An aggregated table; `units` has one entry per column ("s", "ms", "tok/s", "%", "tok", "")."""

    key: str
    title: str
    columns: tuple[str, ...]
    units: tuple[str, ...]
    rows: tuple[Row, ...]
    note: str = ""
    n_label: str = "n"


@dataclass(frozen=True)
class Report:
    """Everything one command prints: tables plus free-text remarks (bad lines, warnings)."""

    title: str
    tables: tuple[Table, ...]
    remarks: tuple[str, ...] = ()
    extra: dict[str, object] = field(default_factory=dict)
    """Machine-readable additions for `--format json` (e.g. the server tasks)."""


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(values: Sequence[float], qs: Sequence[float]) -> tuple[float | None, ...]:
    """The given quantiles of the values, then their maximum."""
    return (*(quantile(values, q) for q in qs), max(values) if values else None)


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    """Length of the intersection of [a0, a1] and [b0, b1] (0 if disjoint)."""
    return max(0.0, min(a1, b1) - max(a0, b0))
