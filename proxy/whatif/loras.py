"""The `lora` field each request reaches the server with under a what-if's `[lora]` config, and the
key llama-server batches by (`can_batch_with`: same adapters and scales). Pure.

The adapters the server has loaded are not in the log; the ids the log's `lora` fields name stand
for them, so `fixed` and `none` build the profile slotwise would (`proxy/ops/lora.py`) over those.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from proxy.config import ConfigError, LoraConfig
from proxy.ops.lora import ServerAdapter, build_lora_array
from proxy.report.records import lora_key


def adapters_in(records: Iterable[Mapping[str, Any]]) -> tuple[ServerAdapter, ...]:
    """The adapter ids any `lora_in` or `lora_out` names."""
    ids: set[int] = set()
    for record in records:
        for value in (record.get("lora_in"), record.get("lora_out")):
            if isinstance(value, list):
                ids.update(e["id"] for e in value if isinstance(e, Mapping)
                           and isinstance(e.get("id"), int) and not isinstance(e.get("id"), bool))
    return tuple(ServerAdapter(i, f"adapter-{i}.gguf") for i in sorted(ids))


class LoraPlan:
    """What each request forwards, under one `[lora]` config."""

    def __init__(self, config: LoraConfig, adapters: Sequence[ServerAdapter]) -> None:
        self.mode = config.mode
        self.note = ""
        self._array: list[dict[str, Any]] | None = None
        if config.mode == "passthrough":
            return
        try:
            self._array = build_lora_array(config, adapters, "the log")
        except ConfigError:
            # Adapters named by file name, or none in the log: one array of its own all the same.
            self._array = [{"id": a.name if a.id is None else a.id, "scale": a.scale}
                           for a in config.adapters] if config.mode == "fixed" else []
            self.note = ("lora: the log does not show which adapters the config names; every "
                         "request gets the same settings all the same")

    def forwarded(self, lora_in: Any) -> tuple[Any, bool]:
        """(the `lora` field forwarded, whether slotwise rewrote it)."""
        if self.mode == "passthrough" or (self._array is None and self.mode == "none"):
            return lora_in, False
        return self._array, self._array != lora_in


def batch_key(lora: Any) -> str:
    """What llama-server compares: an absent or empty field means its global settings."""
    return lora_key(lora) if isinstance(lora, list) and lora else "default"


def explicit(lora: Any) -> bool:
    return isinstance(lora, list) and bool(lora)
