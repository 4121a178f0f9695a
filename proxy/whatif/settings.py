"""The settings a what-if runs under: llama-server's flags (`ServerSettings`) and slotwise's own
config, each `--set KEY=VALUE` applied to the recorded ones. Slotwise keys go through
`proxy.config.parse_config`, so an error names the dotted key and the valid values; any other key
must be a server flag, or the error lists them. Pure, apart from reading the files it is given.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.config import Config, ConfigError, parse_config
from proxy.testbed.server import COMMAND_LINE


class SettingsError(ValueError):
    """A setting the what-if cannot use; the message is one line naming the key."""


@dataclass(frozen=True)
class ServerSettings:
    """llama-server's flags the model follows (docs/whatif.md)."""

    n_batch: int = 2048
    """-b: most tokens in one batch (decode tokens first, then prompt tokens)."""
    n_ubatch: int = 512
    """-ub: the batch is computed in micro-batches of this many tokens (each with its fixed part)."""
    parallel: int = 4
    """-np: slots (automatic -np is 4 slots with one shared KV)."""
    kv_unified: bool = True
    """-kvu: one KV pool for all slots (each attends over every cell in use), else one per slot."""
    ctx: int = 0
    """-c: context cells in all (per slot: ctx / parallel unless kv_unified); 0: no limit."""
    cache_ram: int = 8192
    """--cache-ram MiB for the RAM prompt cache; 0: off; -1: no byte limit."""
    cache_idle_slots: bool = True
    """--cache-idle-slots: idle slots are copied to the RAM cache at every task launch (and
    emptied, with kv_unified)."""
    slot_prompt_similarity: float = 0.1
    """-sps: a slot is chosen by prompt similarity above this (0: least recently used only)."""
    checkpoints: bool = False
    """The model needs context checkpoints (SWA, recurrent): two extra batches near a prompt's end."""

    @property
    def n_ctx_slot(self) -> int:
        """One slot's context limit (0: none)."""
        if self.ctx <= 0 or self.kv_unified:
            return max(0, self.ctx)
        return max(256, self.ctx // self.parallel // 256 * 256)


SERVER_KEYS = tuple(f.name for f in dataclasses.fields(ServerSettings))
_CHECKS: dict[str, tuple[type, Callable[[Any], bool], str]] = {
    "n_batch": (int, lambda v: v >= 1, "a whole number >= 1"),
    "n_ubatch": (int, lambda v: v >= 1, "a whole number >= 1"),
    "parallel": (int, lambda v: 1 <= v <= 256, "a whole number between 1 and 256"),
    "kv_unified": (bool, lambda v: True, "true or false"),
    "ctx": (int, lambda v: v >= 0, "a whole number >= 0 (0: no limit)"),
    "cache_ram": (int, lambda v: v >= -1, "MiB, a whole number >= -1 (0: off, -1: no limit)"),
    "cache_idle_slots": (bool, lambda v: True, "true or false"),
    "slot_prompt_similarity": (float, lambda v: 0 <= v <= 1, "a number between 0 and 1"),
    "checkpoints": (bool, lambda v: True, "true or false"),
}
SLOTWISE_TABLES = tuple(f.name for f in dataclasses.fields(Config))


@dataclass(frozen=True)
class Settings:
    server: ServerSettings
    config: Config
    changed: tuple[str, ...] = ()
    """The keys `--set` changed, as given."""


def parse_assignment(item: str) -> tuple[str, Any]:
    """`KEY=VALUE`; the value is read as TOML (`512`, `true`, `0.5`, `[{id = 0}]`), else as a word."""
    key, eq, text = item.partition("=")
    key = key.strip()
    if not eq or not key:
        raise SettingsError(f"{item!r}: expected KEY=VALUE, e.g. n_batch=512 or prefill.mode=chunk")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return key, value


def apply(base: Settings, items: Sequence[str], config_data: Mapping[str, Any]) -> Settings:
    """`base` with every `--set` item applied; `config_data` is the raw config mapping `base.config`
    was parsed from (so the user's own keys are kept)."""
    server = dataclasses.asdict(base.server)
    data = _copy(config_data)
    changed = []
    for item in items:
        key, value = parse_assignment(item)
        changed.append(key)
        if key in _CHECKS:
            server[key] = _server_value(key, value)
        elif "." in key:
            table, _, rest = key.partition(".")
            _put(data, table, rest, value)
        else:
            raise SettingsError(f"{key}: unknown key (valid: {', '.join(SERVER_KEYS)}, or a slotwise "
                                f"config key TABLE.KEY of {', '.join(SLOTWISE_TABLES)}, e.g. "
                                "prefill.mode)")
    for key in ("n_batch", "n_ubatch"):  # slotwise is told the server's sizes
        if f"prefill.{key}" not in changed and key in changed:
            data.setdefault("prefill", {})[key] = server[key]
    return Settings(ServerSettings(**server), config_from(data), tuple(changed))


def config_from(data: Mapping[str, Any]) -> Config:
    data = _copy(data)
    _defaults_for_what_if(data)
    try:
        return parse_config(data)
    except ConfigError as exc:
        raise SettingsError(str(exc)) from None


def load_config_data(path: str | None) -> dict[str, Any]:
    """The recorded slotwise config as a raw mapping ({} for the defaults)."""
    if path is None:
        return {}
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read the config file: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML: {exc}") from None


_STARTUP = re.compile(r"initializing, n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'")
_CONTEXT = re.compile(r"llama_context: +(n_ctx|n_batch|n_ubatch) += (\d+)")


def server_log_settings(lines: Iterable[str]) -> dict[str, Any]:
    """What llama-server's log says of its flags: slots, per-slot context, shared KV (its start-up
    line), and n_ctx/n_batch/n_ubatch where libllama's context lines are in it; the RAM cache's
    flags where the log opens with the command line slotwise's testbed writes (`# slotwise: …`;
    llama-server itself does not log them). The last start wins."""
    found: dict[str, Any] = {}
    for line in lines:
        if line.startswith(COMMAND_LINE):
            found.update(_cache_flags(line[len(COMMAND_LINE):].split()))
        elif (m := _STARTUP.search(line)) is not None:
            slots, per_slot, unified = int(m.group(1)), int(m.group(2)), m.group(3) == "true"
            found.update(parallel=slots, kv_unified=unified,
                         ctx=per_slot if unified else per_slot * slots)
        elif (m := _CONTEXT.search(line)) is not None:
            found[{"n_ctx": "ctx"}.get(m.group(1), m.group(1))] = int(m.group(2))
    return found


def _cache_flags(argv: Sequence[str]) -> dict[str, Any]:
    """The RAM prompt cache's flags in a llama-server command line."""
    found: dict[str, Any] = {}
    for flag, value in zip(argv, [*argv[1:], ""], strict=True):
        if flag in ("--cache-idle-slots", "--no-cache-idle-slots"):
            found["cache_idle_slots"] = flag == "--cache-idle-slots"
        elif flag in ("-cram", "--cache-ram") and re.fullmatch(r"-?\d+", value):
            found["cache_ram"] = int(value)
        elif flag in ("-sps", "--slot-prompt-similarity") and re.fullmatch(r"[\d.]+", value):
            found["slot_prompt_similarity"] = float(value)
    return found


def server_settings(values: Mapping[str, Any]) -> ServerSettings:
    checked = {k: _server_value(k, v) for k, v in values.items()}
    return dataclasses.replace(ServerSettings(), **checked)


def _server_value(key: str, value: Any) -> Any:
    kind, ok, valid = _CHECKS[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is bool and isinstance(value, str) and value.lower() in ("on", "off", "yes", "no"):
        value = value.lower() in ("on", "yes")
    if type(value) is not kind or not ok(value):
        raise SettingsError(f"{key}: {value!r} is not valid (valid: {valid})")
    return value


def _put(data: dict[str, Any], table: str, key: str, value: Any) -> None:
    node = data.setdefault(table, {})
    if not isinstance(node, dict):
        raise SettingsError(f"{table}: expected a table, got {node!r}")
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SettingsError(f"{table}.{key}: {part} is not a table")
    node[last] = value


def _defaults_for_what_if(data: dict[str, Any]) -> None:
    """keep_kv needs the directory llama-server saves into; the model saves nowhere, so the
    working directory stands in for the one named (which need not be on this machine)."""
    keep = data.get("keep_kv")
    if isinstance(keep, dict) and keep.get("enabled") is True:
        keep["dir"] = "."


def _copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
