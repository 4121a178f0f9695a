"""The configuration: frozen dataclasses, read from one TOML file and validated strictly.

`load_config(path)` reads a file; `parse_config(mapping)` validates a mapping. Every error names the
dotted key, the value and what would be valid; unknown keys are errors, never ignored.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proxy.request.admin_endpoints import ADMIN_NAMES


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
    max_event_mb: float = 16.0
    """Largest single event of an upstream stream, in MiB; a larger one ends the request as
    `upstream_error`. A native /completion stream's last event holds the whole prompt as text."""

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
    header_timeout_s: float = 10.0
    """How long a client may take to send a request's headers, from its connecting (on a kept-alive
    connection, from the request's first byte); then the connection is closed."""
    body_timeout_s: float = 60.0
    """How long a client may take to send a request's body once its headers are in; then HTTP 408."""
    keepalive_timeout_s: float = 60.0
    """How long a kept-alive connection may wait, idle, for its next request; then it is closed."""
    max_connections: int = 1024
    """Client connections open at once; one more is answered HTTP 503 and closed. Each request in
    flight also holds a connection to the upstream: allow twice this many open files, plus some."""


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
    max_cold_factor: float = 2.5
    """chunk: the cold request should take at most this × its time alone (as the fitted batch cost
    predicts it); the pauses between pieces shrink when it falls behind. 0: no such bound."""


@dataclass(frozen=True)
class ClientKey:
    name: str
    """Who holds the key: the record's `client` for every request that carries it."""
    key: str = field(default="", repr=False)
    """The key itself (printable ASCII, no spaces); or, with `key_file`, the key read from it."""
    key_file: str = ""
    """A file holding the key (instead of `key`), read at start and at every reload."""


@dataclass(frozen=True)
class AccessConfig:
    clients: tuple[ClientKey, ...] = ()
    """Keys clients must send (`Authorization: Bearer KEY` or `x-api-key: KEY`); none: no key is
    asked for, unless `[upstream] api_key` is set, which clients must then send."""
    admin_key: str = field(default="", repr=False)
    """A key that may call llama-server's admin endpoints and see slotwise's pages; "" = none."""
    admin_key_file: str = ""
    """A file holding the admin key (instead of `admin_key`), read at start and at every reload."""
    allow: tuple[str, ...] = ()
    """Admin endpoints every client may call, e.g. "GET /slots" (valid: request/admin_endpoints.py)."""
    pages: str = "auto"
    """slotwise's /metrics and /slotwise/: open, token (pages_token or admin_key), off; auto: token
    if either is set, else open on a loopback listen address, else off."""
    pages_token: str = field(default="", repr=False)
    """The token for the pages (`Authorization: Bearer TOKEN`, or the password of Basic auth)."""
    pages_token_file: str = ""
    """A file holding the pages token (instead of `pages_token`)."""


@dataclass(frozen=True)
class ClusterConfig:
    node: str = ""
    """This node's name behind a router: the `X-Slotwise-Node` response header and the record's
    `node`; "" = HOSTNAME:PORT (the configured port)."""
    load_format: str = "vllm"
    """How GET /get_load answers: vllm (`{"load": N}`, vllm-router's power_of_two) or sglang (a list
    of per-rank counts, sglang-router's); `?format=` overrides it per request."""
    health_timeout_s: float = 1.0
    """GET /health asks llama-server's /health with this timeout; no answer in time = 503."""


@dataclass(frozen=True)
class WarmConfig:
    """[warm]: warm-ups, a conversation's prompt computed in idle time before its turn (docs/warm.md)."""

    enabled: bool = True
    """Whether POST /slotwise/warm/... is served (false: HTTP 503)."""
    max_pending: int = 8
    """Warm-ups waiting or running at once; one more gets HTTP 429."""
    max_tokens: int = 32768
    """The most prompt tokens one warm-up computes; a longer history is warmed up to this many."""
    expire_s: float = 300.0
    """A warm-up not finished this long after it was asked for ends (expired)."""
    max_per_client: int = 2
    """Warm-ups waiting or running per client (the name of its [access] key, else its
    X-Slotwise-Client or `user`); one more gets HTTP 429. Unnamed clients count only in max_pending."""


@dataclass(frozen=True)
class KeepKvConfig:
    """[keep_kv]: each conversation's KV kept on disk across days (docs/keep-kv.md)."""

    enabled: bool = False
    """Save idle conversations' KV to files and restore them instead of recomputing; needs
    llama-server's --slot-save-path and [prefill] mode defer or chunk (the estimate finds them)."""
    dir: str = ""
    """The directory llama-server was given as --slot-save-path; slotwise reads and deletes there."""
    save_after_idle_s: float = 120.0
    """A conversation idle this long, in an idle slot, is saved (when no request is in flight)."""
    max_disk_gb: float = 32.0
    """Disk the files may take, in GB (10^9 bytes); the least recently used go first."""
    max_files: int = 64
    """Files kept at most; the least recently used go first."""
    max_age_days: float = 14.0
    """A file not saved or restored for this long is deleted."""
    min_tokens: int = 1024
    """A conversation shorter than this is never saved, and a restore must spare this many tokens."""


@dataclass(frozen=True)
class Config:
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    listen: ListenConfig = field(default_factory=ListenConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    access: AccessConfig = field(default_factory=AccessConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    keep_kv: KeepKvConfig = field(default_factory=KeepKvConfig)


LORA_MODES = ("passthrough", "fixed", "none")
PREFILL_MODES = ("off", "defer", "chunk")
LOG_LEVELS = ("debug", "info", "warning", "error")
PAGES_MODES = ("auto", "open", "token", "off")
LOAD_FORMATS = ("vllm", "sglang")
_NODE_NAME = re.compile(r"^[A-Za-z0-9._:@-]{1,64}$")


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
    upstream = _upstream(_table(data, "upstream"))
    return Config(
        upstream=upstream,
        listen=_listen(_table(data, "listen")),
        log=_log(_table(data, "log")),
        lora=_lora(_table(data, "lora")),
        prefill=_prefill(_table(data, "prefill")),
        access=_access(_table(data, "access"), upstream.api_key),
        cluster=_cluster(_table(data, "cluster")),
        warm=_warm(_table(data, "warm")),
        keep_kv=_keep_kv(_table(data, "keep_kv"), data),
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
        max_event_mb=_number(data, "max_event_mb", "upstream.max_event_mb", d.max_event_mb,
                             low=0.01, high=4096),
    )


def _api_key(data: Mapping[str, Any]) -> str:
    """The upstream's key: `api_key`, or the content of `api_key_file`, or "" (never in a message)."""
    return _secret(data, "api_key", "upstream.", "holding the key of llama-server's --api-key",
                   ", as given to llama-server's --api-key")


def _secret(data: Mapping[str, Any], key: str, prefix: str, holding: str = "holding the key",
            word: str = "") -> str:
    """A secret given as `key` or in the file `key`_file, or "" (the value is never in a message)."""
    value = data.get(key, "")
    if not isinstance(value, str):  # the value is not shown: it may be the key
        raise ConfigError(f"{prefix}{key}: expected a string, got a {type(value).__name__}")
    path = _string(data, f"{key}_file", f"{prefix}{key}_file", "")
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
        header_timeout_s=_number(data, "header_timeout_s", "listen.header_timeout_s",
                                 d.header_timeout_s, low=0.1, high=3600),
        body_timeout_s=_number(data, "body_timeout_s", "listen.body_timeout_s",
                               d.body_timeout_s, low=0.1, high=86400),
        keepalive_timeout_s=_number(data, "keepalive_timeout_s", "listen.keepalive_timeout_s",
                                    d.keepalive_timeout_s, low=0.1, high=86400),
        max_connections=_number(data, "max_connections", "listen.max_connections",
                                d.max_connections, low=1, high=1_000_000, integer=True),
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
        max_cold_factor=_cold_factor(data, d.max_cold_factor),
    )


CLIENT_NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
ADMIN_CLIENT = "admin"
"""The record's `client` for a request that carried `access.admin_key` (no client may take it)."""


def _access(data: Mapping[str, Any], upstream_key: str) -> AccessConfig:
    _check_keys(data, "access.", AccessConfig)
    raw = data.get("clients", [])
    if not isinstance(raw, list):
        raise ConfigError(f"access.clients: expected an array of tables like "
                          f"{{ name = \"alice\", key_file = \"/etc/slotwise/alice.key\" }}, got {_show(raw)}")
    clients = tuple(_client(item, f"access.clients[{i}]") for i, item in enumerate(raw))
    admin_key = _secret(data, "admin_key", "access.")
    pages_token = _secret(data, "pages_token", "access.")
    _distinct_keys(clients, admin_key, pages_token, upstream_key)
    pages = _string(data, "pages", "access.pages", "auto", PAGES_MODES)
    if pages == "token" and not (pages_token or admin_key):
        raise ConfigError("access.pages: 'token' needs access.pages_token or access.admin_key "
                          "(valid: set one of them, or pages = 'auto', 'open' or 'off')")
    return AccessConfig(
        clients=clients, admin_key=admin_key,
        admin_key_file=_string(data, "admin_key_file", "access.admin_key_file", ""),
        allow=_allow(data.get("allow", [])), pages=pages, pages_token=pages_token,
        pages_token_file=_string(data, "pages_token_file", "access.pages_token_file", ""))


def _client(item: Any, dotted: str) -> ClientKey:
    if not isinstance(item, Mapping):
        raise ConfigError(f"{dotted}: expected a table like {{ name = \"alice\", key = \"...\" }}, "
                          f"got {_show(item)}")
    _check_keys(item, f"{dotted}.", ClientKey)
    name = _string(item, "name", f"{dotted}.name", "")
    if not CLIENT_NAME.match(name):
        raise ConfigError(f"{dotted}.name: {name!r} is not a name (valid: 1-64 letters, digits "
                          "and . _ @ -, e.g. 'alice')")
    if name == ADMIN_CLIENT:
        raise ConfigError(f"{dotted}.name: {name!r} is the name of the admin key "
                          "(valid: any other name)")
    key = _secret(item, "key", f"{dotted}.")
    if not key:
        raise ConfigError(f"{dotted}: give 'key' (the key itself) or 'key_file' (a file holding it)")
    return ClientKey(name=name, key=key, key_file=_string(item, "key_file", f"{dotted}.key_file", ""))


def _distinct_keys(clients: tuple[ClientKey, ...], admin_key: str, pages_token: str,
                   upstream_key: str) -> None:
    """Every name and key names one holder; no client holds the server's key (no key is shown)."""
    names: dict[str, int] = {}
    holders: dict[str, str] = {}
    if upstream_key:
        holders[upstream_key] = "upstream.api_key"
    for secret, dotted in ((admin_key, "access.admin_key"), (pages_token, "access.pages_token")):
        if secret and secret in holders:
            raise ConfigError(f"{dotted}: the same key as {holders[secret]} (valid: a key of its own)")
        if secret:
            holders[secret] = dotted
    for i, client in enumerate(clients):
        dotted = f"access.clients[{i}]"
        if client.name in names:
            raise ConfigError(f"{dotted}.name: {client.name!r} is already the name of "
                              f"access.clients[{names[client.name]}] (valid: one entry per name)")
        names[client.name] = i
        if client.key in holders:
            raise ConfigError(f"{dotted}.key: the same key as {holders[client.key]} (valid: a key of "
                              "its own for each client; clients never hold the server's key)")
        holders[client.key] = dotted


def _allow(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise ConfigError(f"access.allow: expected an array of strings like [\"GET /slots\"], "
                          f"got {_show(raw)}")
    allowed: list[str] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, str):
            raise ConfigError(f"access.allow[{i}]: expected a string like \"GET /slots\", "
                              f"got {_show(entry)}")
        method, _, path = entry.strip().partition(" ")
        name = f"{method.upper()} {path.strip()}"
        if name not in ADMIN_NAMES:
            raise ConfigError(f"access.allow[{i}]: {entry!r} is not an admin endpoint "
                              f"(valid: {', '.join(ADMIN_NAMES)})")
        if name not in allowed:
            allowed.append(name)
    return tuple(allowed)


def _cluster(data: Mapping[str, Any]) -> ClusterConfig:
    _check_keys(data, "cluster.", ClusterConfig)
    d = ClusterConfig()
    node = _string(data, "node", "cluster.node", d.node)
    if node and not _NODE_NAME.match(node):
        raise ConfigError(f"cluster.node: {node!r} is not a name for a header (valid: 1 to 64 "
                          "letters, digits and . _ : @ -, e.g. 'gpu-box-1')")
    return ClusterConfig(
        node=node,
        load_format=_string(data, "load_format", "cluster.load_format", d.load_format, LOAD_FORMATS),
        health_timeout_s=_number(data, "health_timeout_s", "cluster.health_timeout_s",
                                 d.health_timeout_s, low=0.05, high=60),
    )


def _warm(data: Mapping[str, Any]) -> WarmConfig:
    _check_keys(data, "warm.", WarmConfig)
    d = WarmConfig()
    enabled = data.get("enabled", d.enabled)
    if not isinstance(enabled, bool):
        raise ConfigError(f"warm.enabled: expected true or false, got {_show(enabled)}")
    return WarmConfig(
        enabled=enabled,
        max_pending=_number(data, "max_pending", "warm.max_pending", d.max_pending,
                            low=1, high=10_000, integer=True),
        max_tokens=_number(data, "max_tokens", "warm.max_tokens", d.max_tokens,
                           low=64, high=10_000_000, integer=True),
        expire_s=_number(data, "expire_s", "warm.expire_s", d.expire_s, low=1, high=86400),
        max_per_client=_number(data, "max_per_client", "warm.max_per_client", d.max_per_client,
                               low=1, high=10_000, integer=True),
    )


# ---- [keep_kv] (proxy/keep, docs/keep-kv.md) ----------------------------------------------------

def _keep_kv(data: Mapping[str, Any], whole: Mapping[str, Any]) -> KeepKvConfig:
    _check_keys(data, "keep_kv.", KeepKvConfig)
    d = KeepKvConfig()
    enabled = data.get("enabled", d.enabled)
    if not isinstance(enabled, bool):
        raise ConfigError(f"keep_kv.enabled: expected true or false, got {_show(enabled)}")
    directory = _string(data, "dir", "keep_kv.dir", d.dir)
    if enabled:
        _keep_kv_needs(directory, _table(whole, "prefill").get("mode", PrefillConfig().mode))
    return KeepKvConfig(
        enabled=enabled, dir=directory,
        save_after_idle_s=_number(data, "save_after_idle_s", "keep_kv.save_after_idle_s",
                                  d.save_after_idle_s, low=1, high=7 * 86400),
        max_disk_gb=_number(data, "max_disk_gb", "keep_kv.max_disk_gb", d.max_disk_gb,
                            low=0.001, high=1_000_000),
        max_files=_number(data, "max_files", "keep_kv.max_files", d.max_files,
                          low=1, high=100_000, integer=True),
        max_age_days=_number(data, "max_age_days", "keep_kv.max_age_days", d.max_age_days,
                             low=0.001, high=3650),
        min_tokens=_number(data, "min_tokens", "keep_kv.min_tokens", d.min_tokens,
                           low=64, high=10_000_000, integer=True),
    )


def _keep_kv_needs(directory: str, prefill_mode: Any) -> None:
    """What an enabled [keep_kv] needs: a directory that exists, and an estimated prompt."""
    if not directory:
        raise ConfigError("keep_kv.dir: must name a directory when keep_kv.enabled is true (valid: "
                          "the directory llama-server was given as --slot-save-path)")
    if not Path(directory).is_dir():
        raise ConfigError(f"keep_kv.dir: {directory!r} is not a directory (valid: the directory "
                          "llama-server was given as --slot-save-path)")
    if prefill_mode == "off":
        raise ConfigError("keep_kv.enabled: true needs the prompt's estimate, which prefill.mode "
                          "'off' skips (valid: prefill.mode 'defer' or 'chunk', or keep_kv.enabled "
                          "false)")


def _cold_factor(data: Mapping[str, Any], default: float) -> float:
    value: float = _number(data, "max_cold_factor", "prefill.max_cold_factor", default, low=0,
                           high=100)
    if 0 < value < 1:
        raise ConfigError(f"prefill.max_cold_factor: {value} is below 1: no cold request can take "
                          "less than its time alone (valid: 0 for no bound, or 1 and more)")
    return value
