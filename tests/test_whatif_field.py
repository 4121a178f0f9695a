"""The what-if against the field report's own figures (issue 21, done when), from its parameters
alone: decode ~52 tok/s, its batch-size table (845 / 816 / 719 / 436 tok/s), llama-server with four
slots and one shared KV. One stream generating beside a 25,000-token cold prefill: the report
measured 0.34 tok/s with n_batch 2048 and 2.06 tok/s with 512, the prefill 5 % slower.
"""

from __future__ import annotations

from functools import cache

from proxy.record.schema import Record
from proxy.whatif.costs import CostsFile
from proxy.whatif.predict import Inputs, predict
from proxy.whatif.synth import field_scene, loaded

FIELD = CostsFile(values={}, prefill_rates=((2048, 845.0), (1000, 816.0), (400, 719.0), (150, 436.0)),
                  decode_tok_s=52.0)
"""The report's parameters: its batch-size table (tokens a progress step advanced: ~2048,
600-1,500, 256-600, 64-256) and the decode rate of one stream alone."""
RECORDED = ("parallel=4", "kv_unified=true", "n_batch=2048", "n_ubatch=512")
"""Its server: automatic -np (4 slots, one shared KV), llama-server's default -b and -ub."""


@cache
def scene(n_batch: int, with_stream: bool = True) -> dict[str, Record]:
    records = loaded(field_scene())
    if not with_stream:
        records = [r for r in records if r["id"] == "cold"]
    prediction = predict(Inputs(records, recorded=RECORDED, sets=(f"n_batch={n_batch}",),
                                costs_file=FIELD))
    return {r.id: r for r in prediction.outcome.records}


def stream_rate(n_batch: int) -> float:
    """The stream's token rate while the cold prompt was computed (its record's overlap)."""
    overlap = next(o for o in scene(n_batch)["stream"].overlaps if o.id == "cold")
    return overlap.decode_events / (overlap.decode_ms / 1000.0)


def prefill_rate(n_batch: int, with_stream: bool = True) -> float:
    timings = scene(n_batch, with_stream)["cold"].timings
    assert timings is not None
    return float(timings["prompt_n"]) / (float(timings["prompt_ms"]) / 1000.0)


class TestFieldReport:
    def test_n_batch_2048_freezes_the_stream(self) -> None:
        assert 0.3 <= stream_rate(2048) <= 0.45  # the report: 0.34 tok/s

    def test_n_batch_512_makes_it_stutter(self) -> None:
        assert 1.5 <= stream_rate(512) <= 2.6  # the report: 2.06 tok/s

    def test_the_prefill_slows_by_at_most_ten_percent(self) -> None:
        alone = prefill_rate(2048, with_stream=False)
        assert prefill_rate(512) >= 0.9 * alone  # the report: 802 against 845 tok/s, -5 %

    def test_the_cold_prompt_computes_every_token(self) -> None:
        timings = scene(512)["cold"].timings
        assert timings is not None and timings["prompt_n"] == 25_000
