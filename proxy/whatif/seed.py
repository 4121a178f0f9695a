"""What the replayed slotwise knew of its server when the day began: the file its config names
(`prefill.learned_file`), read as slotwise reads it at start (prefill/learned.py), for the server
the what-if plays: another slot count or `n_batch` is another server, and slotwise would start
afresh. Pure: the file's JSON value in, the learned samples (or why not) out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.prefill.learned import Learned, LearnedError, ServerKey, parse


@dataclass(frozen=True)
class LearnedRead:
    """The file as the command line read it."""

    path: str
    data: Any = None
    """Its JSON value."""
    error: str | None = None
    """Why it could not be read (then `data` is None)."""


@dataclass(frozen=True)
class Seed:
    learned: Learned | None
    """What the policy starts the day with; None: no file to go on (see `note`)."""
    note: str
    afresh: bool = False
    """The file is another server's: the policy starts from nothing, as slotwise would."""


def seed(read: LearnedRead, slots: int, n_batch: int) -> Seed:
    """The file `read` for a server of `slots` slots and slotwise's `n_batch`. The model, the
    llama.cpp build and the slots' context the file names are taken as the day's: the timing log
    does not say them."""
    where = f"prefill.learned_file {read.path}"
    if read.error is not None:
        return Seed(None, f"{where}: {read.error}; the policy starts from the row-by-row price "
                          "the calibration found")
    server = read.data.get("server") if isinstance(read.data, Mapping) else None
    try:
        model, build, slot_ctx = ((server.get("model"), server.get("build"),
                                   server.get("slot_ctx")) if isinstance(server, Mapping)
                                  else (None, None, None))
        if not (isinstance(model, str) and isinstance(build, str) and isinstance(slot_ctx, int)):
            raise LearnedError("no server recorded (its model, build and slot_ctx)")
        key = ServerKey(model, build, slots, slot_ctx, n_batch)
        learned, other = parse(read.data, key)
    except LearnedError as exc:
        return Seed(None, f"{where}: not what slotwise writes ({exc}); the policy starts from the "
                          "row-by-row price the calibration found")
    if learned is None:
        return Seed(None, f"{where}: {other}: the policy starts afresh, as slotwise would",
                    afresh=True)
    return Seed(learned, f"{where}: the policy starts from its {learned.summary()}, as slotwise "
                         "did (the file as it is now: written after the day, it may hold what "
                         "the day itself taught)")
