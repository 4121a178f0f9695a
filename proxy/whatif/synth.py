"""Made-up workloads in the timing log's shape, for tests, the speed figure and the docs: a day of
chat users like the field report's (sessions whose first turn recomputes a long history, turns that
extend it, summaries that fold it, a few translations), and the report's own scene (one stream
generating when a 25,000-token cold prompt arrives). The records carry what a request asks of the
server (prompt, cached prefix, tokens generated), not how long it took: a replay adds that. Pure.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

from proxy.report.records import parse_time

DAY_START = datetime(2025, 11, 5, 3, 20, tzinfo=UTC).timestamp()
"""The field report's day began at 03:20."""


def record(rid: str, t: float, client: str | None, prompt: int, cached: int, generated: int, *,
           purpose: str = "chat", lora: Any = None) -> dict[str, Any]:
    """A finished streamed chat request as slotwise logs it, minus the times."""
    return {
        "id": rid, "start": datetime.fromtimestamp(DAY_START + t, UTC).isoformat(
            timespec="milliseconds"),
        "method": "POST", "endpoint": "/v1/chat/completions", "kind": "chat", "status": 200,
        "stream": True, "outcome": "done", "client": client, "purpose": purpose,
        "prompt_tokens": prompt, "computed_tokens": prompt - cached, "events": generated,
        "timings": {"prompt_n": prompt - cached, "cache_n": cached, "predicted_n": generated},
        "lora_in": lora, "lora_out": lora,
    }


def field_scene(cold_tokens: int = 25_000, stream_tokens: int = 4_000,
                cold_after_s: float = 5.0) -> list[dict[str, Any]]:
    """One stream generating; `cold_after_s` later a cold prompt of `cold_tokens` arrives."""
    return [record("stream", 0.0, "a", 300, 0, stream_tokens),
            record("cold", cold_after_s, "b", cold_tokens, 0, 200)]


def day(requests: int = 1000, users: int = 5, hours: float = 24.0, seed: int = 7, *,
        warmups: bool = False) -> list[dict[str, Any]]:
    """`requests` requests over `hours`: each user's sessions start at random times; a session's
    first turn brings back a 12,000-25,000-token history, then turns 20-90 s apart add 50-300
    tokens and a 100-600-token reply; every 12-20 turns a summary folds the history to 3,000-8,000
    new tokens; one request in twenty is a translation of 300-2,000 tokens. `warmups`: a summary
    is asked over the history, the chat app then asks for a warm-up of the folded prompt (as
    docs/warm.md recommends), and the next turn finds it computed (besides the `requests`)."""
    rng = random.Random(seed)
    per_user = max(1, requests // users)
    out: list[dict[str, Any]] = []
    span = hours * 3600.0
    for u in range(users):
        client = f"user{u + 1}"
        sessions = max(1, per_user // 60)
        turns_left = per_user
        starts = sorted(rng.uniform(0, span * 0.9) for _ in range(sessions))
        for s, t in enumerate(starts):
            turns = turns_left if s == sessions - 1 else per_user // sessions
            turns_left -= turns
            out += _session(rng, client, t, turns, f"{client}-{s}", warmups)
    out.sort(key=lambda r: str(r["start"]))
    if not warmups:
        return out[:requests]
    kept = [r for r in out if r["kind"] != "warm"][:requests]
    last = str(kept[-1]["start"]) if kept else ""
    return sorted(kept + [r for r in out if r["kind"] == "warm" and str(r["start"]) <= last],
                  key=lambda r: str(r["start"]))


def _session(rng: random.Random, client: str, t: float, turns: int, tag: str,
             warmups: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    prompt, cached = rng.randint(12_000, 25_000), 0
    fold_in = rng.randint(12, 20)
    for n in range(turns):
        rid = f"{tag}-{n:03d}"
        if rng.random() < 0.05:
            size = rng.randint(300, 2_000)
            out.append(record(rid, t, client, size, 0, rng.randint(100, 400), purpose="translate"))
            t += rng.uniform(5, 30)
            continue
        reply = rng.randint(100, 600)
        purpose = "chat"
        if warmups and n and n % fold_in == 0:
            t, prompt, cached = _folded(rng, out, rid, client, t, prompt, cached)
            continue
        if n and n % fold_in == 0:
            prompt, cached, purpose = rng.randint(3_000, 8_000), 500, "summary"
        out.append(record(rid, t, client, prompt, cached, reply, purpose=purpose))
        cached = prompt + reply
        prompt = cached + rng.randint(50, 300)
        t += rng.uniform(20, 90) + reply / 50.0
    return out


def _folded(rng: random.Random, out: list[dict[str, Any]], rid: str, client: str, t: float,
            prompt: int, cached: int) -> tuple[float, int, int]:
    """A summary over the history, the warm-up of the folded prompt as it ends, and the next turn's
    time, prompt and cached tokens (all of the warmed prefix)."""
    summary = rng.randint(200, 500)
    out.append(record(f"{rid}-sum", t, client, prompt, cached, summary, purpose="summary"))
    t += summary / 50.0 + 0.5
    folded = rng.randint(3_000, 8_000)
    out.append({**record(f"{rid}-warm", t, client, folded, 0, 0), "kind": "warm",
                "endpoint": "/slotwise/warm/v1/chat/completions", "stream": False, "status": 202,
                "timings": None, "events": None, "computed_tokens": None,
                "est_prompt_tokens": folded, "est_new_tokens": folded})
    turn_at = t + rng.uniform(10, 40)
    out.append({**record(rid, turn_at, client, folded + rng.randint(50, 300), folded,
                         rng.randint(100, 600)), "warmed_tokens": folded,
                "warm_ids": [f"{rid}-warm"]})
    last = out[-1]
    return turn_at + rng.uniform(20, 90), last["prompt_tokens"] + last["events"] + rng.randint(
        50, 300), last["prompt_tokens"] + last["events"]


def loaded(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as `load_timing_log` gives them (with their arrival as epoch seconds)."""
    return sorted(({**r, "_t0": parse_time(str(r["start"]))} for r in records),
                  key=lambda r: float(r["_t0"]))
