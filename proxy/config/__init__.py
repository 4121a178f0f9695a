"""The configuration: frozen dataclasses, read from one TOML file and validated strictly.

`load_config(path)` reads a file; `parse_config(mapping)` validates a mapping. Every error names the
dotted key, the value and what would be valid; unknown keys are errors, never ignored.
"""
from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proxy.config.access import ADMIN_CLIENT, access_table
from proxy.config.features import cluster_table, keep_kv_table, warm_table
from proxy.config.fields import check_keys, table
from proxy.config.tables import (
    listen_table,
    log_table,
    lora_table,
    prefill_table,
    upstream_table,
)
from proxy.config.values import (
    CACHE_SCOPES,
    LOAD_FORMATS,
    LOG_LEVELS,
    LORA_MODES,
    NODE_NAME,
    PAGES_MODES,
    PREFILL_MODES,
    AccessConfig,
    CacheScope,
    ClientKey,
    ClusterConfig,
    Config,
    ConfigError,
    KeepKvConfig,
    ListenConfig,
    LoadFormat,
    LogConfig,
    LogLevel,
    LoraAdapter,
    LoraConfig,
    LoraMode,
    PagesMode,
    PrefillConfig,
    PrefillMode,
    UpstreamConfig,
    WarmConfig,
)


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        bad = exc.object[exc.start:exc.start + 1].hex()
        raise ConfigError(f"{path}: the config file is not UTF-8 text: byte 0x{bad} at offset "
                          f"{exc.start} (valid: a TOML file in UTF-8)") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_config(data)


def parse_config(data: Mapping[str, Any]) -> Config:
    """Validate a mapping (a parsed TOML document) into a Config."""
    check_keys(data, "", Config)
    upstream = upstream_table(table(data, "upstream"))
    return Config(
        upstream=upstream,
        listen=listen_table(table(data, "listen")),
        log=log_table(table(data, "log")),
        lora=lora_table(table(data, "lora")),
        prefill=prefill_table(table(data, "prefill")),
        access=access_table(table(data, "access"), upstream.api_key),
        cluster=cluster_table(table(data, "cluster")),
        warm=warm_table(table(data, "warm")),
        keep_kv=keep_kv_table(table(data, "keep_kv")),
    )


MASK = "***"
"""What `config_to_dict` shows instead of a secret."""


def config_to_dict(config: Config) -> dict[str, Any]:
    """The effective config as plain data (for printing and the status page), secrets masked."""
    data = dataclasses.asdict(config)
    if data["upstream"]["api_key"]:
        data["upstream"]["api_key"] = MASK
    access = data["access"]
    access["clients"] = [{**client, "key": MASK} for client in access["clients"]]
    for secret in ("admin_key", "pages_token"):
        if access[secret]:
            access[secret] = MASK
    return data


__all__ = [
    "ADMIN_CLIENT",
    "CACHE_SCOPES",
    "LOAD_FORMATS",
    "LOG_LEVELS",
    "LORA_MODES",
    "MASK",
    "NODE_NAME",
    "PAGES_MODES",
    "PREFILL_MODES",
    "AccessConfig",
    "CacheScope",
    "ClientKey",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "KeepKvConfig",
    "ListenConfig",
    "LoadFormat",
    "LogConfig",
    "LogLevel",
    "LoraAdapter",
    "LoraConfig",
    "LoraMode",
    "PagesMode",
    "PrefillConfig",
    "PrefillMode",
    "UpstreamConfig",
    "WarmConfig",
    "config_to_dict",
    "load_config",
    "parse_config",
]
