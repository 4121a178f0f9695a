"""Request ids: each request's id is unique, and a client's own `X-Request-Id` stays visible in it.

A client's id (made a safe token by `clientstrings.clean_id`) is used as it is, unless a request in
flight or one of the last `RECENT` requests already has it: then it gets a suffix, `~` and 6 hex
digits (`abc` → `abc~3f9a1c`), so no two records share an id, the status page never mixes two
requests up, and the client's id is still the start of the id. A request without one gets a new id.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable

RECENT = 10_000
"""How many issued ids are remembered besides those in flight."""
SUFFIX_SEP = "~"


class RequestIds:
    """Issues the id of every request, remembering the last `recent` ones."""

    def __init__(self, recent: int = RECENT, token: Callable[[int], str] | None = None) -> None:
        self._order: deque[str] = deque()
        self._seen: set[str] = set()
        self._recent = recent
        self._token = token or (lambda n: uuid.uuid4().hex[:n])

    def issue(self, wanted: str | None, in_flight: Callable[[str], bool]) -> str:
        """The id for a new request: `wanted` (the client's, already cleaned) when it is free, else
        `wanted` with a suffix; a new 16-hex-digit id when the client sent none."""
        rid = wanted or self._token(16)
        while rid in self._seen or in_flight(rid):
            rid = f"{wanted}{SUFFIX_SEP}{self._token(6)}" if wanted else self._token(16)
        self._remember(rid)
        return rid

    def _remember(self, rid: str) -> None:
        self._order.append(rid)
        self._seen.add(rid)
        if len(self._order) > self._recent:
            self._seen.discard(self._order.popleft())
