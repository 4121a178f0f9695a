"""analyze-log on a real llama-server log: a long prefill overlapping a generation.

Stream A (short prompt, long generation) decodes alone until the server logs its first `n_gen`
line; then request B brings a cold prompt sized (from a warm-up) to take about 6 s to prefill.
B's prompt rides along A's decode steps, so A's tg_3s collapses. Sizes adapt to the machine's
speed, because the 2 cores are shared.
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

PREFILL_TARGET_S = 6.0  # the server logs progress lines only after 3 s of prefill


def complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        result: dict[str, Any] = json.load(response)
    return result


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 250) for _ in range(n)]


def wait_for_line(path: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {needle!r} line in {path}"
        time.sleep(0.1)


@pytest.mark.real_server
@pytest.mark.slow
def test_long_prefill_overlapping_generation(
    start_llama_server: Any, small_model: Any, tmp_path: Path
) -> None:
    server = start_llama_server(small_model, lora=False, args=("-np", "2", "-c", "32768", "-b", "512"))
    rng = random.Random(0)
    results = [complete(server.url, {"prompt": tokens(rng, 512), "n_predict": 64, "ignore_eos": True})]
    warm = results[0]["timings"]
    prefill_rate = warm["prompt_n"] / (warm["prompt_ms"] / 1000)
    decode_rate = warm["predicted_n"] / (warm["predicted_ms"] / 1000)
    long_n = int(min(14000, max(2048, prefill_rate * PREFILL_TARGET_S)))
    # A must outlive B's prefill: ~4 s alone before it, ~4 s after it.
    a_n = int(max(400, decode_rate * 8))

    def run_a() -> None:
        results.append(
            complete(server.url, {"prompt": "Once upon a time", "n_predict": a_n, "ignore_eos": True})
        )

    a = threading.Thread(target=run_a)
    a.start()
    wait_for_line(server.log_path, "n_gen =", timeout=120)
    results.append(complete(server.url, {"prompt": tokens(rng, long_n), "n_predict": 4}))
    a.join(timeout=300)
    time.sleep(0.3)  # the release line follows the response

    text = server.log_path.read_text(errors="replace")
    log = parse_server_log(text.splitlines())
    assert log.counts[UNRECOGNISED] == 0, log.unrecognised
    tasks = rebuild_tasks(log.events)
    assert len(tasks) == len(results) == 3
    got = sorted((t.prompt_n or -1, t.predicted_n or -1) for t in tasks)
    want = sorted((r["timings"]["prompt_n"], r["timings"]["predicted_n"]) for r in results)
    assert got == want
    long = next(t for t in tasks if t.prompt_n == long_n)
    assert long.progress, "the long prompt should log 'prompt processing' lines"

    rows = {r.label: r for r in task_tables.tg3s_table(tasks, 2000).rows}
    during = rows["while another slot prefilled >= 2,000 tokens"]
    otherwise = rows["otherwise"]
    assert during.n >= 1 and otherwise.n >= 1, text[-3000:]
    assert during.values[0] is not None and otherwise.values[0] is not None
    assert during.values[0] < 0.1 * otherwise.values[0]

    # The CLI on the same log: JSON tasks, and both timeline pictures.
    png, html = tmp_path / "t.png", tmp_path / "t.html"
    args = ["analyze-log", str(server.log_path), "--long-prefill", "2000", "--big-new", "2000"]
    assert main([*args, "--timeline", str(png)]) == 0
    assert main([*args, "--timeline", str(html)]) == 0
    assert png.stat().st_size > 10_000 and "data-timeline-ready" in html.read_text()


@pytest.mark.real_server
def test_a_slot_taken_over_by_a_new_prompt_shows_as_a_slow_switch(
    start_llama_server: Any, small_model: Any, tmp_path: Path
) -> None:
    """With one slot and the RAM prompt cache on (the default), a new unrelated prompt makes
    llama-server copy the slot's long prompt to RAM before it starts: a slot switch of tens of ms,
    where the first task (an empty slot) switches in well under a millisecond."""
    server = start_llama_server(small_model, lora=False, args=("-np", "1", "-c", "8192"))
    rng = random.Random(1)
    complete(server.url, {"prompt": tokens(rng, 3000), "n_predict": 1})
    complete(server.url, {"prompt": tokens(rng, 20), "n_predict": 1})
    tasks = rebuild_tasks(parse_server_log(server.log_path.read_text().splitlines()).events)
    empty, taken_over = [t.slot_switch_ms for t in tasks]
    assert empty is not None and taken_over is not None
    assert empty < 5.0 < task_tables.SLOW_SWITCH_MS <= taken_over
    rows = task_tables.slot_switch_table(tasks).rows
    assert sum(row.values[0] or 0 for row in rows) == 1  # one slow switch, counted once
