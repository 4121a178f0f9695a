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
    file is not here, cannot be read (a truncated or half-copied file raises about anything in
    the reader), or does not say. Models whose KV is not per layer and head (MLA's compressed
    latent, `kv_lora_rank`) give None; sliding-window layers are counted whole."""
    if not Path(path).is_file():
        return None
    try:
        reader = gguf.GGUFReader(path)
        arch = _value(reader, "general.architecture")
        if not isinstance(arch, str) or _value(reader, f"{arch}.attention.kv_lora_rank") is not None:
            return None
        layers = _value(reader, f"{arch}.block_count")
        heads = _value(reader, f"{arch}.attention.head_count")
        kv_heads = _value(reader, f"{arch}.attention.head_count_kv")
        embedding = _value(reader, f"{arch}.embedding_length")
        key_len = _value(reader, f"{arch}.attention.key_length")
        value_len = _value(reader, f"{arch}.attention.value_length")
    except Exception:  # a file the reader cannot parse (truncated, not GGUF) says nothing
        return None
    kv_heads = heads if kv_heads is None else kv_heads
    if key_len is None or value_len is None:  # llama.cpp's default: embedding / heads
        if not isinstance(heads, int) or heads <= 0 or not isinstance(embedding, int):
            return None
        key_len = embedding // heads if key_len is None else key_len
        value_len = embedding // heads if value_len is None else value_len
    if not isinstance(layers, int) or not isinstance(key_len, int) or not isinstance(value_len, int):
        return None
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    if len(per_layer) != layers or not all(isinstance(h, int) for h in per_layer):
        return None
    size = sum(per_layer) * (key_len + value_len) * F16_BYTES
    return float(size) if size > 0 else None


def _value(reader: gguf.GGUFReader, key: str) -> Any:
    """One metadata field's value (a string, a number, a list); None when the file has none."""
    field = reader.get_field(key)
    return None if field is None else field.contents()
