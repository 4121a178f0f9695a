"""Where llama-server puts each slot's cells in one shared KV, and how far a decode token's
attention reaches. Pure.

llama.cpp's `find_slot` (src/llama-kv-cache.cpp) takes the first free cells from its head, which
sits after the last cells it placed; it goes back to the start only when more than the cells in use
plus twice the batch's lie before the head. Every token's attention then runs over the cells up to
the highest one in use (`used_max_p1`, padded to 256 with flash attention), hidden by the mask or
not. So the cells a slot lets go below another's leave the span where it was: streams whose cells
went in after a long prompt keep paying for its span after it is gone, until they end. On the
testbed, three streams' steps took 16.5 ms in such a span of ~18,000 cells with 800 of their own,
against 11.3 ms before the long prompt came (`bench contention --scenario field`, direct); with a
12,309-token prompt held in another slot they took 1.31-1.37× (`slotwise bench kv`).

A slot's cells are kept in the order they were placed; a slot that keeps only its first `n` tokens
(a new prompt sharing `n` with what it held, an idle slot emptied) frees the rest.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

PAD = 256
"""The span is padded to this many cells (flash attention's kernels need it)."""
GROW = 1 << 16
"""Cells added at a time to a KV of no fixed size (`-c 0` in the model)."""


class KvCells:
    """One shared KV's cells: which slot holds each, and in what order it placed them."""

    def __init__(self, size: int = 0) -> None:
        self.fixed = size > 0
        n = size if self.fixed else GROW
        self.owner = np.full(n, -1, dtype=np.int32)
        self.pos = np.zeros(n, dtype=np.int32)
        self.count: dict[int, int] = {}
        self.head = 0
        self.used = 0
        self.top = 0
        """One past the highest cell in use."""

    def span(self) -> int:
        """The cells each token's attention runs over."""
        if not self.top:
            return 0
        padded = -(-self.top // PAD) * PAD
        return min(padded, len(self.owner)) if self.fixed else padded

    def sync(self, held: Mapping[int, int]) -> None:
        """Each slot in `held` now holds that many cells: the first ones kept, more placed."""
        for slot, n in held.items():
            have = self.count.get(slot, 0)
            if n < have:
                self._trim(slot, n)
            elif n > have:
                self.place(slot, n - have)

    def place(self, slot: int, n: int) -> None:
        """`find_slot` for `n` cells of `slot`."""
        if n <= 0:
            return
        start = 0 if self.head > self.used + 2 * n else self.head
        free = np.flatnonzero(self.owner[start:] < 0)[:n] + start
        if len(free) < n and start:
            free = np.concatenate((free, np.flatnonzero(self.owner[:start] < 0)[:n - len(free)]))
        while len(free) < n and not self.fixed:
            old = len(self.owner)
            self.owner = np.concatenate((self.owner, np.full(GROW, -1, dtype=np.int32)))
            self.pos = np.concatenate((self.pos, np.zeros(GROW, dtype=np.int32)))
            free = np.concatenate((free, np.arange(old, old + min(GROW, n - len(free)))))
        if not len(free):
            return  # full: the server model fails the batch first (rule 7)
        have = self.count.get(slot, 0)
        self.owner[free] = slot
        self.pos[free] = np.arange(have, have + len(free))
        self.count[slot] = have + len(free)
        self.used += len(free)
        last = int(free[-1]) + 1
        self.head = last % len(self.owner)
        self.top = max(self.top, int(free.max()) + 1)

    def _trim(self, slot: int, keep: int) -> None:
        gone = np.flatnonzero((self.owner == slot) & (self.pos >= keep))
        self.owner[gone] = -1
        self.count[slot] = keep
        self.used -= len(gone)
        if len(gone) and int(gone.max()) + 1 >= self.top:
            live = np.flatnonzero(self.owner[:self.top] >= 0)
            self.top = int(live[-1]) + 1 if len(live) else 0
