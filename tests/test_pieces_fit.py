"""What `slotwise bench pieces` makes of its pieces: the fitted batch cost, `chunk`'s way on at each
prefix, and the layout advice. Pieces are synthetic (a known cost shape); no server."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.bench.pieces import PieceCost, PieceFigures, costs_toml, fit_pieces, outlooks
from proxy.bench.pieces_cli import advice_lines, fit_table
from proxy.prefill.batch_cost import BatchCost
from proxy.prefill.layout import ServerLayout
from proxy.prefill.outlook import ChunkKnobs
from proxy.prefill.strategy import Strategy
from proxy.whatif.costs import load_costs
from tests.test_batch_cost import CPU, GPU
from tests.test_output import printed

KNOBS = ChunkKnobs(max_stall_ms=160.0, n_batch=2048, prefill_share=0.55, max_hold_ms=30_000.0)
PREFIXES = (300, 3000, 6000)


def swept(truth: BatchCost, streams: int = 1) -> PieceFigures:
    """What `bench pieces --prefix 300,3000,6000 --sizes 64,128,256,512` would measure of `truth`."""
    figures = PieceFigures(streams=streams, short_prompt_ms=[30.0])
    for prefix in PREFIXES:
        done = prefix
        for n in (64, 128, 256, 512):
            ms = truth.batch_ms(n, done, streams)
            figures.pieces.append(PieceCost(n, done, ms, ms + 8.0))
            done += n
    return figures


def test_the_pieces_are_written_as_a_whatif_costs_file(tmp_path: Path) -> None:
    figures = swept(CPU, streams=2)
    path = tmp_path / "pieces.toml"
    path.write_text(costs_toml(figures, "testbed small model", "-np 4 -kvu"))
    given = load_costs(str(path))
    assert [(p.tokens, p.prefix, p.decoders) for p in given.pieces] == [
        (p.tokens, p.prefix, 2) for p in figures.pieces]
    assert [p.prompt_ms for p in given.pieces] == pytest.approx(
        [p.prompt_ms for p in figures.pieces], abs=0.01)
    assert path.read_text().startswith("# slotwise bench pieces: testbed small model "
                                       "(llama-server -np 4 -kvu), 2 streams decoding")
    path.write_text(costs_toml(PieceFigures(streams=2), "testbed small model", None))
    assert load_costs(str(path)).pieces == ()


def test_the_fit_finds_the_measured_shape() -> None:
    cost = fit_pieces(swept(CPU)).cost
    for n, prefix in ((64, 3000), (128, 3000), (512, 6000), (96, 9000)):
        assert abs(cost.batch_ms(n, prefix, 1) / CPU.batch_ms(n, prefix, 1) - 1) < 0.05


def test_pieces_shrink_as_the_prefix_grows_on_a_cpu() -> None:
    seen = outlooks(fit_pieces(swept(CPU)), PREFIXES, 1, KNOBS)
    fitting = [o.fitting_piece for o in seen]
    assert fitting == sorted(fitting, reverse=True) and fitting[0] > fitting[-1]
    assert all(o.choice.strategy is Strategy.PIECES for o in seen)


def test_a_gpu_gets_whole_batches() -> None:
    seen = outlooks(fit_pieces(swept(GPU)), PREFIXES, 1, KNOBS)
    assert [o.fitting_piece for o in seen] == [2048] * 3


def test_the_fit_table_keeps_every_figure_at_80_columns() -> None:
    fitted = fit_pieces(swept(CPU))
    text = printed(fit_table(fitted.describe(), outlooks(fitted, PREFIXES, 1, KNOBS), KNOBS))
    assert "…" not in text
    assert "fitted: batch ≈" in text and "6,000" in text and "ms per 1k ctx" in text


def test_advice_for_a_shared_pool() -> None:
    lines = advice_lines(ServerLayout(slots=4, slot_ctx=32768, train_ctx=32768))
    assert lines[0].startswith("llama-server: 4 slots of 32768 tokens") and lines[0].endswith("Flags:")
    assert any("run -np N without -kvu" in line for line in lines[1:])


def test_advice_for_separate_caches() -> None:
    lines = advice_lines(ServerLayout(slots=5, slot_ctx=8192, train_ctx=32768))
    assert lines == ["llama-server: 5 slots of 8192 tokens, a KV cache per slot; nothing in its "
                     "layout costs chunk a lot that slotwise can see (it cannot see "
                     "--cache-idle-slots: run --no-cache-idle-slots, docs/prefill.md)"]
