"""Timelines: lane assignment, phases and stall marks (pure), and the HTML and PNG files."""

from __future__ import annotations

import builtins
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.report.model import Segment, Span
from proxy.report.records import InputError
from proxy.report.timeline import assign_lanes, layout
from proxy.report.timeline_html import timeline_html
from proxy.report.timeline_png import write_png

EXCERPT = Path(__file__).parent / "data" / "server-excerpt.log"


def span(key: str, start: float, end: float, **kw: Any) -> Span:
    return Span(key=key, start=start, end=end, **kw)


def test_greedy_lanes_keep_overlapping_requests_apart() -> None:
    spans = [span("a", 0, 10), span("b", 1, 3), span("c", 4, 6), span("d", 2, 12)]
    assert assign_lanes(spans) == {"a": 0, "b": 1, "c": 1, "d": 2}


def test_slots_are_lanes_when_known() -> None:
    assert assign_lanes([span("a", 0, 1, slot=3), span("b", 0, 1, slot=1)]) == {"a": 3, "b": 1}


def test_phases_long_prefill_and_stalls() -> None:
    spans = [
        span(
            "a",
            100,
            120,
            prefill_start=101,
            first_token=102,
            predicted_n=100,
            predicted_ms=18000,
            segments=(Segment(105, 110, 0.2, "during"), Segment(110, 115, 5.0, "after")),
        ),
        span("b", 104, 112, prefill_start=104, first_token=111, prompt_n=20000),
    ]
    tl = layout(spans)
    phases = [(b.key, b.phase, b.start, b.end) for b in tl.bars]
    assert ("a", "wait", 0, 1) in phases and ("a", "decode", 2, 20) in phases
    assert ("b", "long prefill", 4, 11) in phases
    assert [(m.start, m.end) for m in tl.marks] == [(5, 10)]  # 0.2 < 25% of 5.56 tok/s
    assert tl.lanes == 2


def test_a_prompt_fed_in_pieces_shows_as_fed_not_as_waiting() -> None:
    cold = span("c", 10, 20, prefill_start=17, first_token=18, prompt_n=100, fed_n=2900,
                pieces=12, first_piece=11)
    phases = [(b.phase, b.start, b.end) for b in layout([cold], big_new=1000).bars]
    assert phases == [("wait", 0, 1), ("fed in pieces", 1, 7), ("long prefill", 7, 8),
                      ("decode", 8, 10)]


def test_html_is_self_contained() -> None:
    page = timeline_html(layout([span("a", 0, 5, prefill_start=1, first_token=2)]), "t <x>")
    assert "<script" in page and "data-timeline-ready" in page
    assert "src=" not in page and "<link" not in page and "href=" not in page
    assert "t &lt;x&gt;" in page


def test_png_written(tmp_path: Path) -> None:
    out = tmp_path / "t.png"
    assert main(["analyze-log", str(EXCERPT), "--timeline", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(InputError, match=r"needs matplotlib: pip install 'slotwise\[plot\]'"):
        write_png(layout([span("a", 0, 1)]), "t", str(tmp_path / "x.png"))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")
def test_html_runs_in_headless_chromium(tmp_path: Path) -> None:
    page = tmp_path / "timeline.html"
    assert main(["analyze-log", str(EXCERPT), "--timeline", str(page)]) == 0
    result = subprocess.run(
        [
            str(CHROMIUM),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert 'data-timeline-ready="1"' in result.stdout, result.stderr[-2000:]
    assert 'data-bars="' in result.stdout and 'data-bars="0"' not in result.stdout
    assert "Uncaught" not in result.stderr
