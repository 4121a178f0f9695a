"""What the model file tells the what-if: one token's KV in bytes, from the GGUF's own metadata
(layers, KV heads, key and value lengths, at llama-server's default f16 cache), for the model
llama-server's log says it loaded. Reads the file's header only; None whenever it cannot tell.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf

_LOADING = re.compile(r"loading model '(.+)'")
F16_BYTES = 2
"""llama-server's default KV cache type (`-ctk`/`-ctv f16`)."""


def model_path(lines: Iterable[str]) -> str | None:
    """The model file llama-server's log says it loaded (its last start)."""
    path = None
    for line in lines:
        if (m := _LOADING.search(line)) is not None:
            path = m.group(1)
    return path


def kv_bytes_per_token(path: str) -> float | None:
    """One token's K and V over every layer, f16, as the GGUF's metadata gives them; None when the
    file is not here or does not say."""
    if not Path(path).is_file():
        return None
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError):
        return None
    fields = {name: _value(f) for name, f in reader.fields.items()}
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        return None
    layers, heads = fields.get(f"{arch}.block_count"), fields.get(f"{arch}.attention.head_count")
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    embedding = fields.get(f"{arch}.embedding_length")
    if not isinstance(layers, int) or not isinstance(heads, int) or heads <= 0:
        return None
    default_len = embedding // heads if isinstance(embedding, int) else None
    key_len = fields.get(f"{arch}.attention.key_length", default_len)
    value_len = fields.get(f"{arch}.attention.value_length", default_len)
    if not isinstance(key_len, int) or not isinstance(value_len, int):
        return None
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if len(per_layer) != layers or not all(isinstance(h, int) for h in per_layer):
        return None
    return float(sum(per_layer) * (key_len + value_len) * F16_BYTES)


def _value(field: Any) -> Any:
    """A metadata field's value (a string, a number, a list), or None where it cannot be read."""
    try:
        return field.contents()
    except (AttributeError, ValueError, IndexError):
        return None
