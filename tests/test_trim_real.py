"""The prefill policy's rule 19 on a real llama-server (the testbed's small model, on this CPU):
follow-up turns of a few dozen new tokens after a long history go row by row through the CPU's
flash attention; once slotwise has seen that, the next such turn is trimmed (64 of its cached
tokens computed again with it, in one tile) and its reply comes sooner."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from proxy.testbed.words import WORDS, filler
from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import http as call
from tests.helpers import read_records

pytestmark = pytest.mark.real_server


def test_a_short_follow_up_after_a_long_history_is_trimmed_and_computed_faster(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, small_model: Any) -> None:
    server = start_llama_server(small_model, lora=False, args=["-np", "4", "-c", "32768"])
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
