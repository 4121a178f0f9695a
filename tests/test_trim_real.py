"""The prefill policy's rule 19 on a real llama-server (the testbed's small model, on this CPU):
follow-up turns of a few dozen new tokens after a long history go row by row through the CPU's
flash attention; once slotwise has seen that, the next such turn is trimmed (64 of its cached
tokens computed again with it, in one tile) and its reply comes sooner."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.testbed.server import LlamaServer
from proxy.testbed.words import WORDS, filler
from tests.conftest import StartProxy
from tests.helpers import http as call
from tests.helpers import read_records

pytestmark = pytest.mark.real_server


@pytest.fixture(scope="module")
def server(llama_server_binary: Path, small_model: Any, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LlamaServer]:
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with LlamaServer(small_model.model, lora=None, args=["-np", "4", "-c", "32768"],
                     binary=llama_server_binary, log_path=log) as running:
        yield running


def test_a_short_follow_up_after_a_long_history_is_trimmed_and_computed_faster(
        server: LlamaServer, start_proxy: StartProxy) -> None:
    proxy = start_proxy(server.url, prefill={"mode": "chunk", "cold_tokens": 100_000})
    rng = random.Random(5)
    messages = [{"role": "user", "content": filler(rng, 650, WORDS[:8])}]
    for turn in range(5):
        body = {"messages": messages, "max_tokens": 4, "stream": False, "temperature": 0}
        reply = call("POST", proxy.url + "/v1/chat/completions", body)
        assert reply.status_code == 200, reply.content
        answer = reply.json()["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"And then, part {turn}?"}]
    proxy.stop()  # every record written
    history, *follow_ups = read_records(proxy)
    assert history["timings"]["prompt_n"] > 2500
    short = [r for r in follow_ups if r["prefill_plan"] != "trimmed"]
    trimmed = [r for r in follow_ups if r["prefill_plan"] == "trimmed"]
    # the first three teach slotwise the row-by-row price; then every such turn is trimmed
    assert len(short) >= 3 and trimmed, [(r["prefill_plan"], r["policy_note"]) for r in follow_ups]
    assert all(r["timings"]["prompt_n"] < 64 for r in short)
    for r in trimmed:
        timings = r["timings"]
        assert timings["prompt_n"] == 64, timings  # its new tokens and 64 - them of its cached ones
        assert timings["cache_n"] == r["prompt_tokens"] - 64
        assert r["policy_note"].startswith("trimmed: its ")
        assert r["pieces"] == 0 and r["fed_tokens"] == 0  # nothing of it fed ahead
    # what the user waits for, the trim piece included (here 554-564 ms before, 282 ms trimmed)
    before = statistics.median(r["total_ms"] for r in short)
    after = max(r["total_ms"] for r in trimmed)
    assert after < 0.8 * before, (before, after)
