"""How a record's request or task ended, as the record's `outcome` names it: one enum for every
kind of record (docs/record.md lists which kinds end which ways).
"""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    # -- every request --------------------------------------------------------------------------
    DONE = "done"
    CLIENT_GONE = "client_gone"
    """The client left (also a restore whose request left)."""
    UPSTREAM_ERROR = "upstream_error"
    PROXY_ERROR = "proxy_error"
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    REJECTED = "rejected"
    """A bound turned it away (the prefill queue, the warm-ups' bounds; 429/503)."""
    SHUTDOWN = "shutdown"
    # -- slotwise's own work: warm-ups, saves and restores ---------------------------------------
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"
    EXPIRED = "expired"
    FAILED = "failed"
    CHANGED = "changed"
    """A save whose slot held other tokens by the time it was written (the file is deleted)."""
