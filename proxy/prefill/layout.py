"""What slotwise can tell of llama-server's layout from outside, and the advice for `chunk` it gives.

llama-server reports its slot count and each slot's context (`/props`) and the model's training
context (`/v1/models`), but not whether its KV cache is one pool shared by every slot (`-kvu`, or
automatic slots). It can be inferred: a shared pool gives each slot the whole context (capped by the
training context), separate caches split it. Pure: values in, sentences out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_CHUNK_SLOTS = 3
"""`chunk` needs a slot for the prompt being fed, one per stream, and one free for short turns."""


@dataclass(frozen=True)
class ServerLayout:
    slots: int | None = None
    """`/props` total_slots."""
    slot_ctx: int | None = None
    """`/props` default_generation_settings.n_ctx: each slot's context."""
    train_ctx: int | None = None
    """`/v1/models` meta.n_ctx_train: the model's training context."""
    model: str | None = None
    """`/props` model_path: the model file the server runs."""
    build: str | None = None
    """`/props` build_info: llama.cpp's version and commit."""

    @property
    def shared_kv(self) -> bool | None:
        """Slots as large as the training context (None: cannot tell). One KV pool gives every slot
        the whole context; so does `-c 0` (the default) with an explicit `-np N`, which sizes the
        context N × the training context. `/props` and `/slots` look alike for both (checked on
        the testbed: `-np 4` and `-np 4 -kvu` both show 4 slots of 32,768), so this says "maybe a
        pool", and the advice says both."""
        if self.slots is None or self.slot_ctx is None or self.train_ctx is None:
            return None
        return self.slots > 1 and self.slot_ctx >= self.train_ctx

    def describe(self) -> str:
        kv = {True: "each as large as the model's training context", False: "a KV cache per slot",
              None: "KV layout unknown"}[self.shared_kv]
        return f"{self.slots or '?'} slots of {self.slot_ctx or '?'} tokens, {kv}"


def read_layout(props: Any, models: Any) -> ServerLayout:
    """The layout from the JSON of `/props` and of `/v1/models` (either may be None)."""
    slots = _positive(props.get("total_slots")) if isinstance(props, dict) else None
    settings = props.get("default_generation_settings") if isinstance(props, dict) else None
    slot_ctx = _positive(settings.get("n_ctx")) if isinstance(settings, dict) else None
    model = props.get("model_path") if isinstance(props, dict) else None
    build = props.get("build_info") if isinstance(props, dict) else None
    return ServerLayout(slots=slots, slot_ctx=slot_ctx, train_ctx=_train_ctx(models),
                        model=model if isinstance(model, str) else None,
                        build=build if isinstance(build, str) else None)


def _train_ctx(models: Any) -> int | None:
    data = models.get("data") if isinstance(models, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    meta = first.get("meta") if isinstance(first, dict) else None
    return _positive(meta.get("n_ctx_train")) if isinstance(meta, dict) else None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def layout_advice(mode: str, layout: ServerLayout) -> list[str]:
    """One sentence per thing in this layout that costs `chunk` a lot (nothing for other modes)."""
    if mode != "chunk":
        return []
    advice = []
    if layout.slots is not None and layout.slots < MIN_CHUNK_SLOTS:
        advice.append(
            f"prefill.mode = chunk, but llama-server has {layout.slots} slot(s): a short turn will "
            "take the slot of the prompt being fed and llama-server will copy that prefix to RAM and "
            "back; run it with -np N, N = the streams you expect at peak plus two "
            "(docs/prefill.md, 'llama-server flags that work best')")
    if layout.shared_kv:
        advice.append(
            f"prefill.mode = chunk, and llama-server runs {layout.describe()}: one KV pool shared "
            "by the slots (-kvu, or automatic slots), or -np N with -c 0; slotwise cannot tell "
            "which. With a pool every batch attends over every slot's cells and idle slots are "
            "emptied to RAM after each task, so pieces cost more and help the streams less: run "
            "-np N without -kvu, -c sized for N of your longest histories, and "
            "--no-cache-idle-slots (docs/prefill.md)")
    return advice
