"""What slotwise infers of llama-server's KV layout from /props and /v1/models, and its advice."""

from __future__ import annotations

from proxy.prefill.layout import ServerLayout, layout_advice, read_layout


def props(slots: int, ctx: int) -> dict[str, object]:
    return {"total_slots": slots, "default_generation_settings": {"n_ctx": ctx}}


MODELS = {"data": [{"id": "m", "meta": {"n_ctx_train": 32768}}]}


def test_separate_caches_split_the_context() -> None:
    layout = read_layout(props(4, 8192), MODELS)
    assert layout == ServerLayout(slots=4, slot_ctx=8192, train_ctx=32768)
    assert layout.shared_kv is False and layout_advice("chunk", layout) == []


def test_a_slot_as_large_as_the_training_context_may_be_one_pool() -> None:
    layout = read_layout(props(4, 32768), MODELS)
    assert layout.shared_kv is True
    (advice,) = layout_advice("chunk", layout)
    assert "one KV pool shared by the slots" in advice and "--no-cache-idle-slots" in advice


def test_one_slot_has_nothing_to_share() -> None:
    assert read_layout(props(1, 32768), MODELS).shared_kv is False


def test_unknown_without_the_training_context() -> None:
    layout = read_layout(props(4, 32768), None)
    assert layout.shared_kv is None and layout_advice("chunk", layout) == []


def test_few_slots_warned_in_chunk_mode_only() -> None:
    layout = read_layout(props(2, 16384), MODELS)
    (advice,) = layout_advice("chunk", layout)
    assert "2 slot(s)" in advice
    assert layout_advice("defer", layout) == layout_advice("off", layout) == []


def test_garbage_is_unknown() -> None:
    assert read_layout("nope", [1, 2]) == ServerLayout()
    assert read_layout({"total_slots": True}, {"data": []}) == ServerLayout()
