"""Refused requests' records, bounded: one client sending thousands of requests slotwise refuses
(no key, an admin endpoint, a body it cannot take) cannot fill the disk with their records. Pure:
the caller passes the time in, and writes what this says to write.

Rules of `RefusalSampler` (tests/test_refusals.py follows them one to one):
1. A refusal is a request slotwise answered itself with a client error before any upstream work:
   outcome `unauthorized`, `forbidden` or `bad_request`. Every other record is written, always.
2. Refusals are counted per key: the peer's address, the outcome and the status. A key's minute
   starts at its first refusal; the first `whole` refusals of the minute are written whole.
3. The others of that minute are not written: they are counted, and once the minute is over one
   summary record (kind `refusals`) says how many (`refused_count`), from which peer, with which
   outcome and status. A minute without any held back leaves no summary.
4. At most `max_keys` keys are followed at once: past them, a refusal of a new key counts under the
   key of the peer `(other peers)` with its outcome and status.
Requests = records of any other kind + the `refused_count` of every `refusals` record
(`requests_in`); `/metrics` counts every request, written whole or not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.record.kind import Kind
from proxy.record.outcome import Outcome
from proxy.record.schema import Record

REFUSALS = frozenset({"unauthorized", "forbidden", "bad_request"})
"""The outcomes of rule 1."""
WHOLE_PER_MINUTE = 5
WINDOW_S = 60.0
MAX_KEYS = 256
OTHER_PEERS = "(other peers)"


@dataclass(frozen=True)
class RefusalKey:
    peer: str
    outcome: Outcome
    status: int | None


@dataclass
class _Minute:
    started: float
    """When its first refusal came (the caller's clock)."""
    start: str | None
    """That refusal's record's `start` (wall clock, ISO 8601): the summary's."""
    config_gen: int | None
    node: str | None
    written: int = 0
    held: int = 0


@dataclass(frozen=True)
class Summary:
    """The refusals of one key's minute that were not written."""

    key: RefusalKey
    start: str | None
    count: int
    config_gen: int | None
    node: str | None


class RefusalSampler:
    def __init__(self, whole: int = WHOLE_PER_MINUTE, window_s: float = WINDOW_S,
                 max_keys: int = MAX_KEYS) -> None:
        self.whole = whole
        self.window_s = window_s
        self.max_keys = max_keys
        self._minutes: dict[RefusalKey, _Minute] = {}
        self.not_written: Counter[str] = Counter()
        """Refusals counted in a summary instead of written, by outcome, since start."""

    def admit(self, record: Record, peer: str | None, now: float) -> bool:
        """Whether to write `record` now (rules 1, 2); False: it is counted for a summary (rule 3)."""
        if record.outcome not in REFUSALS:
            return True
        key = RefusalKey(peer or "-", record.outcome, record.status)
        if key not in self._minutes and len(self._minutes) >= self.max_keys:
            key = RefusalKey(OTHER_PEERS, record.outcome, record.status)
        minute = self._minutes.get(key)
        if minute is None:
            minute = self._minutes[key] = _Minute(now, record.start, record.config_gen, record.node)
        if minute.written < self.whole:
            minute.written += 1
            return True
        minute.held += 1
        self.not_written[record.outcome] += 1
        return False

    def due(self, now: float) -> list[Summary]:
        """The summaries of the minutes over by `now` (rule 3); those keys start anew."""
        over = [key for key, minute in self._minutes.items() if now - minute.started >= self.window_s]
        return [summary for key in over if (summary := self._close(key)) is not None]

    def flush(self) -> list[Summary]:
        """Every summary now, whether its minute is over or not (slotwise is stopping)."""
        return [summary for key in list(self._minutes) if (summary := self._close(key)) is not None]

    def _close(self, key: RefusalKey) -> Summary | None:
        minute = self._minutes.pop(key)
        if not minute.held:
            return None
        return Summary(key, minute.start, minute.held, minute.config_gen, minute.node)

    def __len__(self) -> int:
        return len(self._minutes)


def summary_record(summary: Summary, rid: str, whole: int = WHOLE_PER_MINUTE) -> Record:
    """The one record that stands for the refusals of a key's minute that were not written."""
    key = summary.key
    return Record(
        id=rid, start=summary.start, kind=Kind.REFUSALS, status=key.status, outcome=key.outcome,
        error=(f"{summary.count} more requests from {key.peer} refused the same way "
               f"({key.status} {key.outcome}) within a minute of the first: the first {whole} "
               "have records of their own, these are counted here"),
        config_gen=summary.config_gen, node=summary.node, refused_count=summary.count,
        peer=key.peer)


def requests_in(record: Mapping[str, Any]) -> int:
    """How many requests one record of the timing log stands for: a summary its `refused_count`,
    any other record one."""
    if record.get("kind") != Kind.REFUSALS:
        return 1
    count = record.get("refused_count")
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0
