"""The configuration: frozen dataclasses, read from one TOML file and validated strictly.

`load_config(path)` reads a file; `parse_config(mapping)` validates a mapping. Every error names the
dotted key, the value and what would be valid; unknown keys are errors, never ignored.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the dotted key."""


@dataclass(frozen=True)
class UpstreamConfig:
    url: str = "http://127.0.0.1:8080"
    """Base URL of the llama-server slotwise sits in front of."""
    connect_timeout_s: float = 5.0
    """How long to wait for a TCP connection to the upstream."""
    read_timeout_s: float = 3600.0
    """Longest silence on an upstream response. A queued stream gets no bytes until its prefill starts."""
    api_key: str = field(default="", repr=False)
    """The key of a llama-server run with `--api-key`, sent as `Authorization: Bearer KEY` on
    slotwise's own calls (never on forwarded requests); "" = none. With `api_key_file`, the key
    read from that file. Never printed: `config_to_dict` shows it as "***"."""
    api_key_file: str = ""
    """A file holding the key (instead of `api_key`), read at start and at every reload."""

    def auth_headers(self) -> dict[str, str]:
        """The headers slotwise's own upstream calls carry: the key, if there is one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ListenConfig:
    host: str = "127.0.0.1"
    """Address slotwise listens on."""
    port: int = 8081
    """Port slotwise listens on."""
    max_body_mb: float = 64.0
    """Largest request body accepted; a larger one gets HTTP 413."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM, how long streams in flight may run on before they are cut."""


@dataclass(frozen=True)
class LogConfig:
    timing: str = "slotwise-timing.jsonl"
    """The JSON-lines file that gets one timing record per request."""
    level: str = "info"
    """Level of slotwise's own log (stderr): debug, info, warning, error."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str | None = None
    """File name of the adapter, as `GET /lora-adapters` reports its path."""
    id: int | None = None
    """Id of the adapter on the server (instead of name)."""
    scale: float = 1.0
    """Scale to apply."""


@dataclass(frozen=True)
class LoraConfig:
    mode: str = "passthrough"
    """passthrough: forward what the client sent; fixed: the configured adapters on every request;
    none: every request with all adapters at scale 0."""
    adapters: tuple[LoraAdapter, ...] = ()
    """Adapters and scales for `fixed`; adapters not named get scale 0."""


@dataclass(frozen=True)
class PrefillConfig:
    mode: str = "off"
    """off: forward at once; defer: hold cold prompts while others generate; chunk: feed them in pieces."""
    cold_tokens: int = 2000
    """A request whose estimated new prompt tokens reach this is cold."""
    max_hold_s: float = 30.0
    """defer: the longest a cold request is held."""
    max_stall_ms: float = 160.0
    """chunk: the longest stall a piece may cause to the generating streams."""
    prefill_share: float = 0.55
    """chunk: the share of time given to the cold prompt's pieces (the rest to the decoders alone)."""
    max_waiting: int = 16
    """Cold requests that may wait for their turn; more get HTTP 503."""
    tokenizer_model: str = ""
    """GGUF file to tokenize with in process (needs slotwise[gguf]); empty: ask the upstream."""
    n_batch: int = 2048
    """chunk: the upstream's `-b` (llama-server does not report it); a piece never exceeds it."""


@dataclass(frozen=True)
class Config:
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    listen: ListenConfig = field(default_factory=ListenConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)


LORA_MODES = ("passthrough", "fixed", "none")
PREFILL_MODES = ("off", "defer", "chunk")
LOG_LEVELS = ("debug", "info", "warning", "error")


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML config file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_config(data)


def parse_config(data: Mapping[str, Any]) -> Config:
    """Validate a mapping (a parsed TOML document) into a Config."""
    _check_keys(data, "", Config)
    return Config(
        upstream=_upstream(_table(data, "upstream")),
        listen=_listen(_table(data, "listen")),
        log=_log(_table(data, "log")),
        lora=_lora(_table(data, "lora")),
        prefill=_prefill(_table(data, "prefill")),
    )


MASK = "***"
"""What `config_to_dict` shows instead of a secret."""


def config_to_dict(config: Config) -> dict[str, Any]:
    """The effective config as plain data (for printing and the status page), secrets masked."""
    data = dataclasses.asdict(config)
    if data["upstream"]["api_key"]:
        data["upstream"]["api_key"] = MASK
    return data


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key}: expected a table, got {_show(value)}")
    return value


def _check_keys(data: Mapping[str, Any], prefix: str, cls: type) -> None:
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in valid:
            raise ConfigError(
                f"{prefix}{key}: unknown key (valid: {', '.join(valid)})"
            )


def _show(value: Any) -> str:
    return repr(value) if not isinstance(value, Mapping) else "a table"


def _number(data: Mapping[str, Any], key: str, dotted: str, default: float, *,
            low: float, high: float = float("inf"), integer: bool = False) -> Any:
    value = data.get(key, default)
    kind = "a whole number" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type:
        raise ConfigError(f"{dotted}: expected {kind}, got {_show(value)}")
    if not low <= value <= high:
        upper = "" if high == float("inf") else f" and {high}"
        raise ConfigError(f"{dotted}: {value} is out of range (valid: between {low}{upper})")
    return int(value) if integer else float(value)


def _string(data: Mapping[str, Any], key: str, dotted: str, default: str,
            choices: tuple[str, ...] = ()) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"{dotted}: expected a string, got {_show(value)}")
    if choices and value not in choices:
        what = dotted.rsplit(".", 1)[-1]
        raise ConfigError(f"{dotted}: unknown {what} {value!r} (valid: {', '.join(choices)})")
    return value


def _upstream(data: Mapping[str, Any]) -> UpstreamConfig:
    _check_keys(data, "upstream.", UpstreamConfig)
    d = UpstreamConfig()
    url = _string(data, "url", "upstream.url", d.url)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"upstream.url: {url!r} is not an http(s) URL with a host "
            "(valid: e.g. 'http://127.0.0.1:8080')"
        )
    return UpstreamConfig(
        url=url.rstrip("/"),
        connect_timeout_s=_number(data, "connect_timeout_s", "upstream.connect_timeout_s",
                                  d.connect_timeout_s, low=0.1, high=600),
        read_timeout_s=_number(data, "read_timeout_s", "upstream.read_timeout_s",
                               d.read_timeout_s, low=0.1, high=86400),
        api_key=_api_key(data),
        api_key_file=_string(data, "api_key_file", "upstream.api_key_file", d.api_key_file),
    )


def _api_key(data: Mapping[str, Any]) -> str:
    """The upstream's key: `api_key`, or the content of `api_key_file`, or "" (never in a message)."""
    key = data.get("api_key", "")
    if not isinstance(key, str):  # the value is not shown: it may be the key
        raise ConfigError(f"upstream.api_key: expected a string, got a {type(key).__name__}")
    path = _string(data, "api_key_file", "upstream.api_key_file", "")
    if key and path:
        raise ConfigError("upstream.api_key: give at most one of 'api_key' and 'api_key_file' "
                          "(valid: the key itself, or a file holding it)")
    dotted = "upstream.api_key"
    if path:
        dotted = "upstream.api_key_file"
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{dotted}: cannot read {path!r}: {why} (valid: a readable file "
                              "holding the key of llama-server's --api-key)") from exc
        if not key:
            raise ConfigError(f"{dotted}: {path!r} is empty (valid: a file holding the key)")
    if not key.isascii() or any(c.isspace() or not c.isprintable() for c in key):
        raise ConfigError(f"{dotted}: the key holds whitespace, control or non-ASCII characters "
                          "(valid: one printable ASCII word, as given to llama-server's --api-key)")
    return key


def _listen(data: Mapping[str, Any]) -> ListenConfig:
    _check_keys(data, "listen.", ListenConfig)
    d = ListenConfig()
    return ListenConfig(
        host=_string(data, "host", "listen.host", d.host),
        port=_number(data, "port", "listen.port", d.port, low=0, high=65535, integer=True),
        max_body_mb=_number(data, "max_body_mb", "listen.max_body_mb", d.max_body_mb,
                            low=0.001, high=4096),
        shutdown_grace_s=_number(data, "shutdown_grace_s", "listen.shutdown_grace_s",
                                 d.shutdown_grace_s, low=0, high=86400),
    )


def _log(data: Mapping[str, Any]) -> LogConfig:
    _check_keys(data, "log.", LogConfig)
    d = LogConfig()
    timing = _string(data, "timing", "log.timing", d.timing)
    if not timing:
        raise ConfigError("log.timing: must name a file (valid: a path such as 'timing.jsonl')")
    return LogConfig(timing=timing,
                     level=_string(data, "level", "log.level", d.level, LOG_LEVELS))


def _lora(data: Mapping[str, Any]) -> LoraConfig:
    _check_keys(data, "lora.", LoraConfig)
    mode = _string(data, "mode", "lora.mode", "passthrough", LORA_MODES)
    raw = data.get("adapters", [])
    if not isinstance(raw, list):
        raise ConfigError(f"lora.adapters: expected an array of tables, got {_show(raw)}")
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
                          f"got {_show(item)}")
    _check_keys(item, f"{dotted}.", LoraAdapter)
    has_name, has_id = "name" in item, "id" in item
    if has_name == has_id:
        raise ConfigError(f"{dotted}: give exactly one of 'name' (the adapter's file name) or 'id'")
    name = _string(item, "name", f"{dotted}.name", "") if has_name else None
    if has_name and not name:
        raise ConfigError(f"{dotted}.name: must not be empty")
    adapter_id = (_number(item, "id", f"{dotted}.id", 0, low=0, high=1 << 20, integer=True)
                  if has_id else None)
    scale = _number(item, "scale", f"{dotted}.scale", 1.0, low=-100.0, high=100.0)
    return LoraAdapter(name=name, id=adapter_id, scale=scale)


def _prefill(data: Mapping[str, Any]) -> PrefillConfig:
    _check_keys(data, "prefill.", PrefillConfig)
    d = PrefillConfig()
    return PrefillConfig(
        mode=_string(data, "mode", "prefill.mode", d.mode, PREFILL_MODES),
        cold_tokens=_number(data, "cold_tokens", "prefill.cold_tokens", d.cold_tokens,
                            low=1, high=10_000_000, integer=True),
        max_hold_s=_number(data, "max_hold_s", "prefill.max_hold_s", d.max_hold_s,
                           low=0, high=3600),
        max_stall_ms=_number(data, "max_stall_ms", "prefill.max_stall_ms", d.max_stall_ms,
                             low=10, high=60_000),
        prefill_share=_number(data, "prefill_share", "prefill.prefill_share", d.prefill_share,
                              low=0.05, high=0.95),
        max_waiting=_number(data, "max_waiting", "prefill.max_waiting", d.max_waiting,
                            low=0, high=10_000, integer=True),
        tokenizer_model=_string(data, "tokenizer_model", "prefill.tokenizer_model",
                                d.tokenizer_model),
        n_batch=_number(data, "n_batch", "prefill.n_batch", d.n_batch, low=32, high=1 << 20,
                        integer=True),
    )
