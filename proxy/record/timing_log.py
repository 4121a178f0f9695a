"""Writes timing records, one JSON line each, and flushes every line as it is written.

Writing is synchronous on purpose: a record is written from `finally` blocks, also while a request is
being cancelled, and one short append to the page cache costs microseconds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import IO

from proxy.record.schema import Record

log = logging.getLogger("slotwise.timing")


class TimingLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] | None = open(self.path, "ab")  # noqa: SIM115 (held open)
        self.written = 0

    def write(self, record: Record) -> None:
        line = record.to_json()
        if self._file is None:
            log.error("timing record %s after the log was closed", record.id)
            return
        try:
            self._file.write(line)
            self._file.flush()
            self.written += 1
        except OSError as exc:  # a full disk must not break the request being served
            log.error("cannot write the timing record of %s: %s", record.id, exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
