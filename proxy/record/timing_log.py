"""Writes timing records, one JSON line each, to the file `[log] timing` names.

Each line goes to the file in one unbuffered `os.write` on a descriptor opened for appending: a line
is in the file when `write` returns, or it is counted in `lost` and never comes out later (a buffered
writer kept the lines a full disk refused and wrote them after the ones that followed). A line cut off
by a full disk is ended with a newline before the next record, so one bad line never spoils two.

`reopen` opens the path anew (SIGHUP after a log rotation, or a reload that moves the log). Writing is
synchronous on purpose: a record is written from `finally` blocks, also while a request is being
cancelled, and one short append to the page cache costs microseconds.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from proxy.config import ConfigError
from proxy.record.clientstrings import clean_id
from proxy.record.log_limit import LogLimit
from proxy.record.outcome import Outcome
from proxy.record.schema import Record

log = logging.getLogger("slotwise.timing")

Write = Callable[[int, bytes | memoryview], int]
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC


def open_append(path: Path) -> int:
    """A descriptor appending to `path` (made, with its directory, if absent); OSError if it cannot."""
    if not path.parent.exists():
        path.parent.mkdir(parents=True)
    return os.open(path, _FLAGS, 0o644)


def cannot_open(path: str | Path, exc: OSError) -> ConfigError:
    """The config error for a timing log that cannot be opened (at start, or on a reload)."""
    return ConfigError(f"log.timing: cannot open {str(path)!r} for appending: "
                       f"{exc.strerror or exc} (valid: a file slotwise may create and append to)")


class TimingLog:
    def __init__(self, path: str | Path, *, write: Write = os.write,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._fd: int | None = open_append(self.path)
        self._write = write
        self._clock = clock
        self._torn = False  # the last line was cut off: the next one starts with a newline
        self._complaints = LogLimit()
        self.written = 0
        self.lost = 0
        """Records that could not be written (a full disk, the log closed): never written later."""

    @classmethod
    def open(cls, path: str | Path) -> TimingLog:
        """The timing log at `path`, or a ConfigError naming `log.timing` and the OS's reason."""
        try:
            return cls(path)
        except OSError as exc:
            raise cannot_open(path, exc) from exc

    def write(self, record: Record) -> bool:
        """Append one record's line; False (and `lost` + 1) if it could not be. Never raises."""
        line = _line(record)
        if self._fd is None:
            return self._lose(record.id, "the timing log is closed")
        try:
            self._append(self._fd, line)
        except OSError as exc:
            return self._lose(record.id, exc.strerror or str(exc))
        self.written += 1
        return True

    def reopen(self, path: str | Path | None = None) -> None:
        """Write to `path` (default: the same path, anew: the file a log rotation left there) from now
        on, and close the old file. If it cannot be opened, OSError, and the old file stays."""
        new_path = Path(path) if path is not None else self.path
        fd = open_append(new_path)
        old, self._fd, self.path, self._torn = self._fd, fd, new_path, False
        if old is not None:
            os.close(old)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _append(self, fd: int, line: bytes) -> None:
        data = memoryview(b"\n" + line if self._torn else line)
        started = False
        try:
            while data:
                done = self._write(fd, data)
                if done <= 0:
                    raise OSError(errno.EIO, "the file took no bytes")
                started = True
                data = data[done:]
        except OSError:
            self._torn = self._torn or started
            raise
        self._torn = False

    def _lose(self, rid: str, why: str) -> bool:
        self.lost += 1
        allowed, left_out = self._complaints.allow(self._clock())
        if allowed:
            more = f" (and {left_out} more not told)" if left_out else ""
            log.error("timing record %s lost: %s; %d records lost so far%s",
                      rid, why, self.lost, more)
        return False


def _line(record: Record) -> bytes:
    """The record's line; a record that cannot be written as JSON (which the record path prevents)
    becomes the certain part of it, so the request still leaves a line."""
    try:
        return record.to_json()
    except (TypeError, ValueError) as exc:
        log.error("timing record %r cannot be written as JSON (%s): writing its id only",
                  record.id, exc)
        return Record(id=clean_id(record.id) or "-", outcome=Outcome.PROXY_ERROR,
                      error="slotwise could not write this record as JSON").to_json()
