"""What the status page and /metrics show of the kept KV. Pure: store values in, plain data out (file
names are hashes; no token ids, no text)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proxy.keep.probe import Probe
from proxy.keep.store import KeepStore

SAVE_OUTCOMES = ("done", "changed", "failed")
RESTORE_OUTCOMES = ("done", "failed", "client_gone")


def status_view(store: KeepStore, probe: Probe, *, directory: str, problem: str | None,
                saves: Mapping[str, int], restores: Mapping[str, int], restored_tokens: int,
                now: float) -> dict[str, Any]:
    """The status page's `keep_kv` section: whether saving works, the files, the conversations."""
    files = sorted(store.files.values(), key=lambda f: f.last_used, reverse=True)
    convs = sorted(store.conversations.values(), key=lambda c: c.ended, reverse=True)
    return {
        "enabled": True, "working": probe.working, "note": probe.note, "problem": problem,
        "dir": directory, "disk_bytes": store.disk_bytes(),
        "budget": {"max_bytes": store.knobs.max_bytes, "max_files": store.knobs.max_files,
                   "max_age_s": store.knobs.max_age_s},
        "files": [{"name": f.name, "tokens": f.tokens, "bytes": f.size, "uses": f.uses,
                   "saved_s_ago": round(now - f.saved_at, 1),
                   "used_s_ago": round(now - f.last_used, 1)} for f in files],
        "conversations": [{"name": c.name, "where": str(store.where(c)), "slot": c.slot,
                           "prompt_tokens": c.prompt_tokens, "idle_s": round(now - c.ended, 1)}
                          for c in convs],
        "saving": None if store.saving is None else store.saving.name,
        "restoring": sorted(r.name for r in store.restoring.values()),
        "saves": {o: saves.get(o, 0) for o in SAVE_OUTCOMES},
        "restores": {o: restores.get(o, 0) for o in RESTORE_OUTCOMES},
        "restored_tokens": restored_tokens,
        "displaced_tokens": store.displaced_tokens,
    }


def keep_metrics(store: KeepStore, working: bool, saves: Mapping[str, int],
                 restores: Mapping[str, int], restored_tokens: int) -> Iterable[Metric]:
    """Read at scrape time."""
    yield GaugeMetricFamily("slotwise_keep_kv_working",
                            "1 when llama-server saves slots where slotwise keeps them (keep_kv)",
                            value=1.0 if working else 0.0)
    yield GaugeMetricFamily("slotwise_keep_kv_disk_bytes",
                            "Bytes of the conversation KV files slotwise keeps on disk",
                            value=store.disk_bytes())
    yield GaugeMetricFamily("slotwise_keep_kv_files", "Conversation KV files slotwise keeps",
                            value=len(store.files))
    for name, what, counts, outcomes in (
            ("saves", "Slot saves to a file", saves, SAVE_OUTCOMES),
            ("restores", "Restores of a file into a slot", restores, RESTORE_OUTCOMES)):
        family = CounterMetricFamily(f"slotwise_keep_kv_{name}", f"{what}, by outcome",
                                     labels=["outcome"])
        for outcome in outcomes:
            family.add_metric([outcome], counts.get(outcome, 0))
        yield family
    yield CounterMetricFamily("slotwise_keep_kv_restored_tokens",
                              "Prompt tokens restored from files instead of recomputed",
                              value=restored_tokens)
    yield CounterMetricFamily("slotwise_keep_kv_displaced_tokens",
                              "Tokens of unsaved conversations restores pushed out of their slots "
                              "(their next turns compute them again)",
                              value=store.displaced_tokens)
