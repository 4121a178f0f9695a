"""analyze-log on a real llama-server log: a long prefill overlapping a generation.

Stream A (short prompt, long generation) runs alone for a few seconds, then request B brings an
8,000-token cold prompt. B's prefill rides along A's decode steps, so A's tg_3s collapses.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.report import task_tables
from proxy.report.serverlog import UNRECOGNISED, parse_server_log
from proxy.report.tasks import rebuild_tasks

LONG_PROMPT = 8000


def complete(url: str, body: dict[str, Any], out: dict[str, Any], key: str) -> None:
    request = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        out[key] = json.load(response)


@pytest.mark.real_server
@pytest.mark.slow
def test_long_prefill_overlapping_generation(
    start_llama_server: Any, small_model: Any, tmp_path: Path
) -> None:
    server = start_llama_server(small_model, lora=False, args=("-np", "2", "-c", "20480"))
    rng = random.Random(0)
    results: dict[str, Any] = {}
    a = threading.Thread(
        target=complete,
        args=(
            server.url,
            {"prompt": "Once upon a time", "n_predict": 1500, "ignore_eos": True, "temperature": 0.0},
            results,
            "a",
        ),
    )
    a.start()
    time.sleep(3.6)  # A decodes alone long enough for one n_gen line
    prompt = [rng.randrange(100, 250) for _ in range(LONG_PROMPT)]
    complete(server.url, {"prompt": prompt, "n_predict": 4, "cache_prompt": True}, results, "b")
    a.join(timeout=120)
    time.sleep(0.3)  # let the last log lines reach the file

    text = server.log_path.read_text(errors="replace")
    log = parse_server_log(text.splitlines())
    assert log.counts[UNRECOGNISED] == 0, log.unrecognised
    tasks = rebuild_tasks(log.events)
    assert len(tasks) == 2
    got = sorted((t.prompt_n, t.predicted_n) for t in tasks)
    want = sorted((r["timings"]["prompt_n"], r["timings"]["predicted_n"]) for r in results.values())
    assert got == want
    long = next(t for t in tasks if t.prompt_n == LONG_PROMPT)
    assert long.progress, "the 8,000-token prompt should log 'prompt processing' lines"

    rows = {r.label: r for r in task_tables.tg3s_table(tasks, 5000).rows}
    during = rows["while another slot prefilled >= 5,000 tokens"]
    otherwise = rows["otherwise"]
    assert during.n >= 1 and otherwise.n >= 1, text[-3000:]
    assert during.values[0] is not None and otherwise.values[0] is not None
    assert during.values[0] < 0.1 * otherwise.values[0]

    # The CLI on the same log: JSON tasks, and both timeline pictures.
    png, html = tmp_path / "t.png", tmp_path / "t.html"
    assert main(["analyze-log", str(server.log_path), "--long-prefill", "5000", "--timeline", str(png)]) == 0
    assert main(["analyze-log", str(server.log_path), "--timeline", str(html)]) == 0
    assert png.stat().st_size > 10_000 and "data-timeline-ready" in html.read_text()
