"""Where the what-if's shared KV puts each slot's cells (proxy/whatif/kvcells.py): llama.cpp's
`find_slot` from its head, back to the start when enough lies free before it, and the span every
token's attention runs over. Plain numbers, no server model."""

from __future__ import annotations

import numpy as np

from proxy.whatif.kvcells import PAD, KvCells


def cells_of(kv: KvCells, slot: int) -> list[int]:
    return np.flatnonzero(kv.owner == slot).tolist()


class TestPlacing:
    def test_cells_go_after_the_last_ones_placed(self) -> None:
        kv = KvCells(4096)
        kv.place(0, 100)
        kv.place(1, 50)
        kv.place(0, 10)
        assert cells_of(kv, 1) == list(range(100, 150))
        assert cells_of(kv, 0) == [*range(100), *range(150, 160)]
        assert kv.span() == PAD

    def test_with_enough_free_before_the_head_it_starts_again_from_the_first_cell(self) -> None:
        kv = KvCells(0)
        kv.place(0, 50)
        kv.place(1, 10_000)
        kv.place(2, 50)
        kv.sync({1: 0})  # the long prompt's slot taken by another conversation
        kv.place(3, 40)
        assert cells_of(kv, 3) == list(range(50, 90))

    def test_a_kv_of_no_fixed_size_grows(self) -> None:
        kv = KvCells(0)
        kv.place(0, 100_000)
        assert kv.count[0] == 100_000 and kv.span() == -(-100_000 // PAD) * PAD

    def test_a_full_kv_places_what_it_can(self) -> None:
        kv = KvCells(512)
        kv.place(0, 500)
        kv.place(1, 50)
        assert kv.count[1] == 12 and kv.span() == 512


class TestSpan:
    def test_a_long_prompt_let_go_below_a_streams_cells_leaves_the_span(self) -> None:
        """As on a `bench contention --scenario field` day: three streams' next turns went in
        after the history, so after the history's slot took a short turn they still read ~17,400
        cells a step (16.5 ms against 11.3 before it)."""
        kv = KvCells(98_304)
        kv.place(3, 16_942)
        for slot in (0, 1, 2):
            kv.place(slot, 42)
        kv.sync({3: 1})  # the history's slot: a short turn sharing one token
        assert kv.used == 127 and kv.span() == -(-(16_942 + 126) // PAD) * PAD
        kv.sync({0: 0, 1: 0, 2: 0})  # the streams end and their slots are emptied
        assert kv.span() == PAD

    def test_a_slot_cut_back_keeps_its_first_cells(self) -> None:
        kv = KvCells(4096)
        kv.place(0, 100)
        kv.place(1, 10)
        kv.place(0, 50)
        kv.sync({0: 120})
        assert cells_of(kv, 0) == [*range(100), *range(110, 130)]
        assert kv.used == 130 and kv.count == {0: 120, 1: 10}
