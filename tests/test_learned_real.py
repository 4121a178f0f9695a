"""`prefill.learned_file` on a real llama-server (the testbed's small model): what slotwise measured
of the server is there again after slotwise restarts, before any request."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.testbed.words import WORDS, filler
from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import http as call

pytestmark = pytest.mark.real_server


def after_start(url: str) -> tuple[str, str]:
    """What became of the learned file, once slotwise has read the server's /props, and the
    prefill section's batch cost then (`fitted` or `prior`)."""
    deadline = time.monotonic() + 10.0
    while True:
        status = call("GET", url + "/slotwise/status").json()
        learned = status["learned_file"]["status"]
        if not learned.startswith("waiting") or time.monotonic() > deadline:
            return learned, str(status["prefill"]["cost"])
        time.sleep(0.1)


def test_what_slotwise_measured_of_the_server_is_kept_across_its_restart(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, tmp_path: Path,
        small_model: Any) -> None:
    server = start_llama_server(small_model, lora=False, args=["-np", "2", "-c", "8192"])
    learned = tmp_path / "kept" / "learned.json"
    learned.parent.mkdir()
    tables = {"prefill": {"mode": "defer", "learned_file": str(learned)}}
    first = start_proxy(server.url, **tables)
    learned_status, cost = after_start(first.url)
    assert learned_status == "no file yet: learning afresh" and "(prior" in cost
    prompt = filler(random.Random(3), 700, WORDS[:8])  # a prefill the batch cost learns from
    reply = call("POST", first.url + "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2})
    assert reply.status_code == 200, reply.content
    assert "(fitted, 1 of 1 samples" in call("GET", first.url + "/slotwise/status").json()[
        "prefill"]["cost"]  # one prefill of 700 tokens, sent whole (nobody else running)
    first.stop()  # written at stop

    kept = orjson.loads(learned.read_bytes())
    assert kept["server"]["model"] == str(small_model.model)
    assert kept["server"]["slots"] == 2 and len(kept["batch_cost"]) == 1
    assert learned.stat().st_mode & 0o777 == 0o600
    assert prompt[:40] not in learned.read_text()  # numbers only, never prompt text

    again = start_proxy(server.url, **tables)
    learned_status, cost = after_start(again.url)  # before any request
    assert learned_status.startswith("taken up: 1 batch-cost samples")
    assert "(fitted, 1 of 1 samples" in cost
    again.stop()
    other = start_proxy(server.url, prefill={**tables["prefill"], "n_batch": 512})
    learned_status, cost = after_start(other.url)
    assert learned_status == ("learned on another server (n_batch was 2048, now 512): learning "
                              "afresh") and "(prior" in cost
