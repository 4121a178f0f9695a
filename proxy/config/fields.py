"""Reading one key of a table strictly: its type, its range or its valid words, a secret read from
a file; every error names the dotted key, the value and what would be valid."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from proxy.config.values import ConfigError

Word = TypeVar("Word", bound=str)


def table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a table, got {show(value)}")
    return value


def check_keys(data: Mapping[str, Any], prefix: str, cls: type) -> None:
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in valid:
            raise ConfigError(
                f"{prefix}{key}: unknown key (valid: {', '.join(valid)})"
            )


def show(value: Any) -> str:
    return repr(value) if not isinstance(value, Mapping) else "a table"


def number(data: Mapping[str, Any], key: str, dotted: str, default: float, *,
            low: float, high: float = float("inf"), integer: bool = False) -> Any:
    value = data.get(key, default)
    kind = "a whole number" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type:
        raise ConfigError(f"{dotted}: expected {kind}, got {show(value)}")
    if not low <= value <= high:
        upper = "" if high == float("inf") else f" and {high}"
        raise ConfigError(f"{dotted}: {value} is out of range (valid: between {low}{upper})")
    return int(value) if integer else float(value)


def flag(data: Mapping[str, Any], key: str, dotted: str, default: bool) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{dotted}: expected true or false, got {show(value)}")
    return value


def string(data: Mapping[str, Any], key: str, dotted: str, default: str) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"{dotted}: expected a string, got {show(value)}")
    if "\0" in value:  # no path, URL or name holds one; the OS refuses it in a path
        raise ConfigError(f"{dotted}: holds a NUL character (valid: text without NUL)")
    return value


def choice(data: Mapping[str, Any], key: str, dotted: str, default: Word,
           choices: tuple[Word, ...]) -> Word:
    """One of `choices` (the words of a `Literal` type in values.py), typed as that word."""
    value = string(data, key, dotted, default)
    for word in choices:
        if value == word:
            return word
    what = dotted.rsplit(".", 1)[-1]
    raise ConfigError(f"{dotted}: unknown {what} {value!r} (valid: {', '.join(choices)})")


def secret(data: Mapping[str, Any], key: str, prefix: str, holding: str = "holding the key",
            word: str = "") -> str:
    """A secret given as `key` or in the file `key`_file, or "" (the value is never in a message)."""
    value = data.get(key, "")
    if not isinstance(value, str):  # the value is not shown: it may be the key
        raise ConfigError(f"{prefix}{key}: expected a string, got a {type(value).__name__}")
    path = string(data, f"{key}_file", f"{prefix}{key}_file", "")
    if value and path:
        raise ConfigError(f"{prefix}{key}: give at most one of '{key}' and '{key}_file' "
                          "(valid: the key itself, or a file holding it)")
    dotted = f"{prefix}{key}"
    if path:
        dotted = f"{prefix}{key}_file"
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{dotted}: cannot read {path!r}: {why} (valid: a readable file "
                              f"{holding})") from exc
        if not value:
            raise ConfigError(f"{dotted}: {path!r} is empty (valid: a file holding the key)")
    if not value.isascii() or any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError(f"{dotted}: the key holds whitespace, control or non-ASCII characters "
                          f"(valid: one printable ASCII word{word})")
    return value
