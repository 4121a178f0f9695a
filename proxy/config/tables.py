"""The parsers of the core tables: [upstream], [listen], [log], [lora], [prefill]."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from proxy.config.fields import check_keys, choice, flag, number, secret, show, string
from proxy.config.values import (
    LOG_LEVELS,
    LORA_MODES,
    PREFILL_MODES,
    ConfigError,
    ListenConfig,
    LogConfig,
    LoraAdapter,
    LoraConfig,
    PrefillConfig,
    UpstreamConfig,
)


def upstream_table(data: Mapping[str, Any]) -> UpstreamConfig:
    check_keys(data, "upstream.", UpstreamConfig)
    d = UpstreamConfig()
    url = string(data, "url", "upstream.url", d.url)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"upstream.url: {url!r} is not an http(s) URL with a host "
            "(valid: e.g. 'http://127.0.0.1:8080')"
        )
    return UpstreamConfig(
        url=url.rstrip("/"),
        connect_timeout_s=number(data, "connect_timeout_s", "upstream.connect_timeout_s",
                                  d.connect_timeout_s, low=0.1, high=600),
        read_timeout_s=number(data, "read_timeout_s", "upstream.read_timeout_s",
                               d.read_timeout_s, low=0.1, high=86400),
        api_key=_api_key(data),
        api_key_file=string(data, "api_key_file", "upstream.api_key_file", d.api_key_file),
        max_event_mb=number(data, "max_event_mb", "upstream.max_event_mb", d.max_event_mb,
                             low=0.01, high=4096),
    )


def _api_key(data: Mapping[str, Any]) -> str:
    """The upstream's key: `api_key`, or the content of `api_key_file`, or "" (never in a message)."""
    return secret(data, "api_key", "upstream.", "holding the key of llama-server's --api-key",
                   ", as given to llama-server's --api-key")


def listen_table(data: Mapping[str, Any]) -> ListenConfig:
    check_keys(data, "listen.", ListenConfig)
    d = ListenConfig()
    return ListenConfig(
        host=string(data, "host", "listen.host", d.host),
        port=number(data, "port", "listen.port", d.port, low=0, high=65535, integer=True),
        max_body_mb=number(data, "max_body_mb", "listen.max_body_mb", d.max_body_mb,
                            low=0.001, high=4096),
        shutdown_grace_s=number(data, "shutdown_grace_s", "listen.shutdown_grace_s",
                                 d.shutdown_grace_s, low=0, high=86400),
        header_timeout_s=number(data, "header_timeout_s", "listen.header_timeout_s",
                                 d.header_timeout_s, low=0.1, high=3600),
        body_timeout_s=number(data, "body_timeout_s", "listen.body_timeout_s",
                               d.body_timeout_s, low=0.1, high=86400),
        keepalive_timeout_s=number(data, "keepalive_timeout_s", "listen.keepalive_timeout_s",
                                    d.keepalive_timeout_s, low=0.1, high=86400),
        max_connections=number(data, "max_connections", "listen.max_connections",
                                d.max_connections, low=1, high=1_000_000, integer=True),
    )


def log_table(data: Mapping[str, Any]) -> LogConfig:
    check_keys(data, "log.", LogConfig)
    d = LogConfig()
    timing = string(data, "timing", "log.timing", d.timing)
    if not timing:
        raise ConfigError("log.timing: must name a file (valid: a path such as 'timing.jsonl')")
    return LogConfig(timing=timing,
                     level=choice(data, "level", "log.level", d.level, LOG_LEVELS))


def lora_table(data: Mapping[str, Any]) -> LoraConfig:
    check_keys(data, "lora.", LoraConfig)
    mode = choice(data, "mode", "lora.mode", "passthrough", LORA_MODES)
    raw = data.get("adapters", [])
    if not isinstance(raw, list):
        raise ConfigError(f"lora.adapters: expected an array of tables, got {show(raw)}")
    adapters = tuple(_adapter(item, f"lora.adapters[{i}]") for i, item in enumerate(raw))
    if mode == "fixed" and not adapters:
        raise ConfigError(
            "lora.adapters: mode 'fixed' needs at least one adapter "
            "(valid: e.g. adapters = [{ name = \"style.gguf\", scale = 0.8 }])"
        )
    return LoraConfig(mode=mode, adapters=adapters)


def _adapter(item: Any, dotted: str) -> LoraAdapter:
    if not isinstance(item, Mapping):
        raise ConfigError(f"{dotted}: expected a table like {{ name = \"x.gguf\", scale = 1.0 }}, "
                          f"got {show(item)}")
    check_keys(item, f"{dotted}.", LoraAdapter)
    has_name, has_id = "name" in item, "id" in item
    if has_name == has_id:
        raise ConfigError(f"{dotted}: give exactly one of 'name' (the adapter's file name) or 'id'")
    name = string(item, "name", f"{dotted}.name", "") if has_name else None
    if has_name and not name:
        raise ConfigError(f"{dotted}.name: must not be empty")
    adapter_id = (number(item, "id", f"{dotted}.id", 0, low=0, high=1 << 20, integer=True)
                  if has_id else None)
    scale = number(item, "scale", f"{dotted}.scale", 1.0, low=-100.0, high=100.0)
    return LoraAdapter(name=name, id=adapter_id, scale=scale)


def prefill_table(data: Mapping[str, Any]) -> PrefillConfig:
    check_keys(data, "prefill.", PrefillConfig)
    d = PrefillConfig()
    return PrefillConfig(
        mode=choice(data, "mode", "prefill.mode", d.mode, PREFILL_MODES),
        cold_tokens=number(data, "cold_tokens", "prefill.cold_tokens", d.cold_tokens,
                            low=1, high=10_000_000, integer=True),
        max_hold_s=number(data, "max_hold_s", "prefill.max_hold_s", d.max_hold_s,
                           low=0, high=3600),
        max_stall_ms=number(data, "max_stall_ms", "prefill.max_stall_ms", d.max_stall_ms,
                             low=10, high=60_000),
        prefill_share=number(data, "prefill_share", "prefill.prefill_share", d.prefill_share,
                              low=0.05, high=0.95),
        max_waiting=number(data, "max_waiting", "prefill.max_waiting", d.max_waiting,
                            low=0, high=10_000, integer=True),
        tokenizer_model=string(data, "tokenizer_model", "prefill.tokenizer_model",
                                d.tokenizer_model),
        n_batch=number(data, "n_batch", "prefill.n_batch", d.n_batch, low=32, high=1 << 20,
                        integer=True),
        n_ubatch=number(data, "n_ubatch", "prefill.n_ubatch", d.n_ubatch, low=1, high=1 << 20,
                         integer=True),
        max_cold_factor=_cold_factor(data, d.max_cold_factor),
        background_purposes=_purposes(data.get("background_purposes", [])),
        trim_short_turns=flag(data, "trim_short_turns", "prefill.trim_short_turns",
                              d.trim_short_turns),
        learned_file=string(data, "learned_file", "prefill.learned_file", d.learned_file),
    )


MAX_PURPOSE = 127
"""The longest purpose a request's record keeps whole: `clientstrings.MAX_CHARS` - 1 (a longer
header value is cut; proxy.config imports nothing of proxy.record, tests/test_config.py checks)."""


def _purposes(raw: Any) -> tuple[str, ...]:
    """`prefill.background_purposes`: the header values as a request sends them (`X-Slotwise-
    Purpose`, printable text of at most MAX_PURPOSE characters: the record keeps no more)."""
    dotted = "prefill.background_purposes"
    if not isinstance(raw, list):
        raise ConfigError(f"{dotted}: expected an array of strings like [\"translation\"], "
                          f"got {show(raw)}")
    for i, entry in enumerate(raw):
        if (not isinstance(entry, str) or not entry or len(entry) > MAX_PURPOSE
                or not entry.isprintable()):
            raise ConfigError(f"{dotted}[{i}]: {show(entry)} is not a purpose (valid: the "
                              f"X-Slotwise-Purpose value, printable text of 1-{MAX_PURPOSE} "
                              "characters, e.g. \"translation\")")
    return tuple(raw)


def _cold_factor(data: Mapping[str, Any], default: float) -> float:
    value: float = number(data, "max_cold_factor", "prefill.max_cold_factor", default, low=0,
                           high=100)
    if 0 < value < 1:
        raise ConfigError(f"prefill.max_cold_factor: {value} is below 1: no cold request can take "
                          "less than its time alone (valid: 0 for no bound, or 1 and more)")
    return value
