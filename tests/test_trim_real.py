"""The prefill policy's rule 19 on a real llama-server (the testbed's small model, on this CPU):
follow-up turns of a few dozen new tokens after a long history go row by row through the CPU's
flash attention; once slotwise has seen that, the next such turn is trimmed (enough of its cached
tokens computed again with it to make one tile of 64) and its reply comes sooner, where that pays
on this CPU, and is sent as it came where it does not. So is a longer turn whose last
micro-batch (llama-server's `-ub` 512) would hold a few dozen rows."""

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
    # a longer turn: 512 + ~30 new tokens, whose last micro-batch would go row by row
    words = 120
    while True:
        longer = [*messages[:-1], {"role": "user", "content": filler(random.Random(7), words,
                                                                      WORDS[:8])}]
        new = _tokens(server.url, longer) - _tokens(server.url, messages[:-1], end=True)
        if 530 <= new <= 555:
            break
        words += 1 if new < 530 else -1
    body = {"messages": longer, "max_tokens": 4, "stream": False, "temperature": 0}
    assert call("POST", proxy.url + "/v1/chat/completions", body).status_code == 200
    proxy.stop()  # every record written
    history, *follow_ups, last = read_records(proxy)
    assert history["timings"]["prompt_n"] > 2500
    short = [r for r in follow_ups if r["prefill_plan"] != "trimmed"]
    trimmed = [r for r in follow_ups if r["prefill_plan"] == "trimmed"]
    assert all(r["timings"]["prompt_n"] < 64 for r in short)
    if last["prefill_plan"] == "trimmed":  # its last micro-batch made a tile: 64 after the 512
        assert last["policy_note"].startswith("trimmed: the last "), last["policy_note"]
        assert last["timings"]["prompt_n"] == 512 + 64, last["timings"]
        assert last["timings"]["cache_n"] == last["prompt_tokens"] - 576
    else:
        assert abs(last["timings"]["prompt_n"] - new) <= 3, (new, last["timings"])  # as it came
    rows_ms, tile_ms = _short_batches(server.url, messages[:-1])
    seen = (rows_ms, tile_ms, [(r["prefill_plan"], r["policy_note"]) for r in [*follow_ups, last]])
    if rows_ms < 1.3 * tile_ms:  # this CPU computes a few rows about as fast as a tile
        # trimming a short turn cannot pay (the trim piece costs a decode step more): none is
        # (the longer turn's last micro-batch is priced on its own: either way, checked above)
        assert not trimmed, seen
        return
    if rows_ms < 2.0 * tile_ms:
        return  # in between: the learned price decides either way (the records are checked above)
    assert last["prefill_plan"] == "trimmed", seen
    # the first three teach slotwise the row-by-row price; then every such turn is trimmed
    assert len(short) >= 3 and trimmed, seen
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


def _short_batches(url: str, history: list[dict[str, str]]) -> tuple[float, float]:
    """What this server's CPU takes for 54 new tokens after the history, row by row, and for 64,
    one tile: the medians of three, straight to llama-server in a slot of their own (one CPU
    took 877 against 327 ms for such turns, another ~195 against ~155 ms)."""
    prompt = call("POST", url + "/apply-template", {"messages": history}).json()["prompt"]
    ids = call("POST", url + "/tokenize", {"content": prompt}).json()["tokens"]
    more = call("POST", url + "/tokenize",
                {"content": filler(random.Random(9), 60, WORDS[:8])}).json()["tokens"]
    times: dict[int, list[float]] = {54: [], 64: []}
    for _ in range(3):
        for n in times:
            base = {"n_predict": 0, "cache_prompt": True, "id_slot": 3}
            assert call("POST", url + "/completion", {**base, "prompt": ids}).status_code == 200
            reply = call("POST", url + "/completion",
                         {**base, "prompt": ids + more[:n], "n_predict": 1})
            assert reply.json()["timings"]["prompt_n"] == n
            times[n].append(reply.json()["timings"]["prompt_ms"])
    return statistics.median(times[54]), statistics.median(times[64])


def _tokens(url: str, messages: list[dict[str, str]], *, end: bool = False) -> int:
    """The prompt's tokens as llama-server renders it; `end`: up to the last message's end only
    (what the slot holds of it before a next user turn: no generation prompt)."""
    body: dict[str, Any] = {"messages": messages}
    if end:
        body["add_generation_prompt"] = False
    prompt = call("POST", url + "/apply-template", body).json()["prompt"]
    return len(call("POST", url + "/tokenize", {"content": prompt}).json()["tokens"])
