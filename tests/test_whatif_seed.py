"""The replayed slotwise starts the day from the learned file its config names, as slotwise does
(whatif/seed.py; its measured effect on `bench day`'s slotwise days is in docs/whatif.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from proxy.cli.main import main
from proxy.prefill.batch_cost import batch_row
from proxy.prefill.learned import Learned, ServerKey, dump
from proxy.report.records import load_timing_log
from proxy.whatif.predict import Inputs, predict
from proxy.whatif.seed import LearnedRead, seed
from proxy.whatif.synth import field_scene, loaded
from tests.test_whatif import RECORDED, TRUTH, TRUTH_FILE

FILE = "/var/lib/slotwise/learned.json"


def learned_file(slots: int = 4, ms_per_token: float = 5.0) -> dict[str, Any]:
    """What a slotwise wrote on a server that computes `ms_per_token` a prompt token."""
    batches = [(batch_row(n, ctx), 10.0 + ms_per_token * n, 10.0 + ms_per_token * n)
               for n in (64, 128, 256, 512, 1024) for ctx in (0, 1000, 2000)]
    return dump(ServerKey("model.gguf", "b1", slots, 8192, 2048), Learned(batches, [], []))


def mid_size_turn(read: LearnedRead | None) -> tuple[str | None, list[str]]:
    """A 1,200-token turn (under `cold_tokens`) 5 s into a stream, replayed with `chunk` and the
    config naming FILE: its plan, and the what-if's notes."""
    scene = loaded(field_scene(cold_tokens=1200, stream_tokens=600))
    config = {"prefill": {"mode": "chunk", "learned_file": FILE}}
    played = predict(Inputs(scene, config_data=config, recorded=RECORDED, costs_file=TRUTH_FILE,
                            learned_file=read))
    turn = next(r for r in played.outcome.records if r.id == "cold")
    return turn.prefill_plan, played.notes


class TestTheDayStartsFromTheFile:
    def test_a_turn_the_file_prices_over_the_streams_promise_goes_in_pieces(self) -> None:
        """The file says this server takes ~6 s for the turn's 1,200 tokens (over 8 ×
        `max_stall_ms`): cold by its stall from the first minute, as the real slotwise judged it.
        Without the file the policy knows only the day's own first prompt (at 0.9 ms a token:
        ~1.1 s whole) and sends it whole."""
        plan, notes = mid_size_turn(LearnedRead(FILE, learned_file()))
        assert plan == "chunked"
        assert any(n.startswith(f"prefill.learned_file {FILE}: the policy starts from its 15 "
                                "batch-cost samples") for n in notes), notes
        plan, notes = mid_size_turn(LearnedRead(FILE, error="cannot be read (No such file)"))
        assert plan == "none"
        assert any("cannot be read (No such file); the policy starts from the row-by-row price"
                   in n for n in notes), notes

    def test_another_servers_file_starts_the_day_afresh(self) -> None:
        """A file learned on five slots, replayed on four: slotwise would not take it up."""
        plan, notes = mid_size_turn(LearnedRead(FILE, learned_file(slots=5)))
        assert plan == "none"
        assert any("another server (slots was 5, now 4): the policy starts afresh" in n
                   for n in notes), notes
        assert seed(LearnedRead(FILE, learned_file(slots=5)), 5, 2048).learned is not None

    def test_a_file_slotwise_did_not_write_is_said_and_passed_by(self) -> None:
        for data in ({"version": 1}, {"version": 9, "server": {"slot_ctx": 1}}, [1, 2]):
            found = seed(LearnedRead(FILE, data), 4, 2048)
            assert found.learned is None and not found.afresh
            assert "not what slotwise writes" in found.note


class TestCommandLine:
    def test_the_config_names_the_file_and_the_command_reads_it(self, tmp_path: Path) -> None:
        log, config, out = tmp_path / "day.jsonl", tmp_path / "slotwise.toml", tmp_path / "o"
        log.write_bytes(b"".join(orjson.dumps(r) + b"\n"
                                 for r in field_scene(cold_tokens=1200, stream_tokens=600)))
        learned = tmp_path / "learned.json"
        config.write_text(f'[prefill]\nmode = "chunk"\nlearned_file = "{learned}"\n')
        costs = tmp_path / "costs.toml"
        costs.write_text(TRUTH.as_toml())
        args = ["whatif", str(log), "--config", str(config), "--costs", str(costs),
                *(a for r in RECORDED for a in ("--recorded", r)), "-o", str(out)]
        plans = {}
        for data in (None, orjson.dumps(learned_file())):
            if data is not None:
                learned.write_bytes(data)
            assert main(args) == 0
            plans[data is None] = next(r for r in load_timing_log(str(out)).records
                                       if r.get("id") == "cold").get("prefill_plan")
        assert plans == {True: "none", False: "chunked"}
