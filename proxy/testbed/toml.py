"""Writes TOML for the slotwise configs that tests, benchmarks and the demo generate: tables of
plain values (bool, number, string, arrays and inline tables of them). The standard library reads
TOML but does not write it, and a generated config needs no more than this.
"""

from __future__ import annotations

from typing import Any

import orjson


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """A TOML document with one `[name]` table per entry of `tables`."""
    lines = []
    for name, table in tables.items():
        lines.append(f"[{name}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return orjson.dumps(value).decode()  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")
