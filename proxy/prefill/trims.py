"""The short turns the prefill policy trims (its rule 19): the row-by-row price this server showed,
learned from the requests that computed a batch of under TILE_ROWS rows and learned again when the
machine changes, and the turns whose trim piece is in flight. Where a trim piece ends and whether it
pays is narrow.py's. Pure.
"""

from __future__ import annotations

from proxy.prefill.cost_fit import BatchCostModel
from proxy.prefill.events import Arrived
from proxy.prefill.narrow import NarrowPrice, Trim, fewest_rows, trim
from proxy.prefill.sizing import TILE_ROWS


class Trims:
    """Rule 19's state: the price, and the turns waiting for their trim piece."""

    def __init__(self) -> None:
        self._price = NarrowPrice()
        self._shifts = 0
        """The batch cost's shifts the price was learned after."""
        self._in_flight: dict[str, Arrived] = {}

    def __len__(self) -> int:
        """The turns whose trim piece is in flight (each keeps its slot)."""
        return len(self._in_flight)

    def samples(self) -> list[float]:
        """The price's samples, oldest first (prefill/learned.py keeps them across restarts)."""
        return list(self._price.samples)

    def adopt(self, samples: list[float], cost: BatchCostModel) -> None:
        """Samples kept from before a restart, learned on the machine `cost` now describes."""
        self._price.adopt(samples)
        self._shifts = cost.shifts

    def learn(self, cost: BatchCostModel, prompt_n: int, cache_n: int, prompt_ms: float,
              decoders: int, cells: int, shared_kv: bool | None) -> None:
        """A finished request's prefill: it teaches the price if it computed fewer rows than a
        tile (with the decode tokens beside it)."""
        if prompt_n and fewest_rows(prompt_n, decoders, shared_kv) < TILE_ROWS:
            self._price.observe(prompt_n, cache_n, prompt_ms,
                                cost.cost.batch_ms(prompt_n, cache_n, decoders, cells))

    def cut(self, cost: BatchCostModel, req: Arrived, decoders: int, cells: int,
            shared_kv: bool | None, *, n_batch: int, n_ubatch: int) -> Trim | None:
        """Its trim piece, if it pays (the turn then waits for it here until `pop`); else None."""
        if cost.shifts != self._shifts:  # the machine changed: learned again
            self._price, self._shifts = NarrowPrice(), cost.shifts
        cut = trim(cost.cost, self._price, req.est_new_tokens, req.est_prompt_tokens, decoders,
                   cells, shared_kv, n_batch=n_batch, n_ubatch=n_ubatch)
        if cut is not None:
            self._in_flight[req.req_id] = req
        return cut

    def pop(self, req_id: str) -> Arrived | None:
        """The turn whose trim piece ended (done, failed or its client gone), if it was one."""
        return self._in_flight.pop(req_id, None)
