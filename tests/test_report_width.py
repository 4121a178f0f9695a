"""`slotwise report` and `analyze-log` in an 80-column terminal (COLUMNS=80): every line fits, and
no figure is cut to make it fit (a label wraps instead)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from tests.test_report import chunked, rec, write_log

EXCERPT = Path(__file__).parent / "data" / "server-excerpt.log"


def day_of_records() -> list[dict[str, Any]]:
    """A working day's log: cold 20,000-token prompts that streams decode through, chunked and
    held turns, sub-second and minute-long turns, warm-ups and keep_kv saves and restores."""
    records: list[dict[str, Any]] = []
    for i in range(12):
        at = i * 300.0
        records.append(rec(f"cold{i}", at, 95.5, wait=0.0, prefill=41.2, prompt_n=21_345,
                           predicted_n=1_204, client=f"user{i % 3}", purpose="first-turn",
                           lora_out="adapter-a" if i % 2 else None, est_new_tokens=21_000))
        ov = {"id": f"cold{i}", "new_tokens": 21_345, "from_ms": 0, "to_ms": 38_000,
              "decode_events": 310, "decode_ms": 38_000}
        records.append(rec(f"short{i}", at + 2, 61.3, wait=1.8, prefill=0.34, prompt_n=240,
                           cache_n=18_700, predicted_n=2_950, overlaps=[ov], client="ann",
                           purpose="chat", inflight_at_start=[f"cold{i}"], lora_rewritten=True))
        records.append(chunked(f"chunk{i}", at + 120, 12.4, wait=4.0, prefill=0.1, client="bob",
                               held_ms=4_000.0))
        records.append(rec(f"held{i}", at + 200, 3.2, wait=2.5, prefill=0.2, prefill_plan="held",
                           held_ms=2_512.0, policy_note="held until others finished",
                           warmed_tokens=1_800 if i % 2 else 0, warm_ids=[f"w{i}"]))
        records.append({**rec(f"w{i}", at + 150, 1.1), "kind": "warm", "fed_tokens": 1_800,
                        "outcome": "done" if i % 3 else "superseded"})
        records.append({**rec(f"save{i}", at + 250, 0.42), "kind": "kv_save",
                        "kv_tokens": 24_000, "kv_bytes": 1.3e9})
        records.append({**rec(f"restore{i}", at + 260, 0.85), "kind": "kv_restore",
                        "kv_tokens": 24_000, "kv_bytes": 1.3e9})
        records.append(rec(f"back{i}", at + 270, 5.5, wait=0.0, prefill=0.3, prompt_n=400,
                           cache_n=23_600, restored_tokens=23_600, client=f"user{i % 3}"))
    return records


def lines_at_80(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "…" not in out  # rich's mark of a cut cell
    return out.splitlines()


@pytest.fixture(autouse=True)
def columns_80(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")


def test_every_report_table_fits_80_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "day.jsonl", day_of_records())
    lines = lines_at_80(["report", str(log)], capsys)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    for title in ("Decode rate of streams", "keep_kv:", "Warm-ups:", "Estimate accuracy"):
        assert title in text
    decode = text[text.index("Decode rate of streams"):text.index("Waits of")]
    assert "8.16 ev/s" in decode  # 310 events in 38 s: the figure is whole, its label wrapped


def test_a_comparison_fits_80_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = day_of_records()
    before = write_log(tmp_path / "before.jsonl", records[: len(records) // 2])
    after = write_log(tmp_path / "after.jsonl", records[len(records) // 2:])
    lines = lines_at_80(["report", "--compare", str(before), str(after)], capsys)
    assert max(len(line) for line in lines) <= 80


def test_analyze_log_fits_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    lines = lines_at_80(["analyze-log", str(EXCERPT), "--long-prefill", "100"], capsys)
    assert max(len(line) for line in lines) <= 80
