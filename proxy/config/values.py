"""The configuration's values: one frozen dataclass per TOML table, with a one-line docstring per
key (the reference the example config and docs follow), and the sets of valid words: each a
`Literal` type for the field, and its words as a tuple (`get_args`) for the parser's checks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, get_args

LoraMode = Literal["passthrough", "fixed", "none"]
PrefillMode = Literal["off", "defer", "chunk"]
LogLevel = Literal["debug", "info", "warning", "error"]
PagesMode = Literal["auto", "open", "token", "off"]
CacheScope = Literal["client", "shared"]
LoadFormat = Literal["vllm", "sglang"]

LORA_MODES: tuple[LoraMode, ...] = get_args(LoraMode)
PREFILL_MODES: tuple[PrefillMode, ...] = get_args(PrefillMode)
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
PAGES_MODES: tuple[PagesMode, ...] = get_args(PagesMode)
CACHE_SCOPES: tuple[CacheScope, ...] = get_args(CacheScope)
LOAD_FORMATS: tuple[LoadFormat, ...] = get_args(LoadFormat)


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
    level: LogLevel = "info"
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
    mode: LoraMode = "passthrough"
    """passthrough: forward what the client sent; fixed: the configured adapters on every request;
    none: every request with all adapters at scale 0."""
    adapters: tuple[LoraAdapter, ...] = ()
    """Adapters and scales for `fixed`; adapters not named get scale 0."""


@dataclass(frozen=True)
class PrefillConfig:
    mode: PrefillMode = "off"
    """off: forward at once; defer: hold cold prompts while others generate; chunk: feed them in pieces."""
    cold_tokens: int = 2000
    """A request whose estimated new prompt tokens reach this is cold."""
    max_hold_s: float = 30.0
    """defer: the longest a cold request is held. With every slot taken, also how long a background
    job (`background_purposes`) lets chat turns have a freed slot first."""
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
    n_ubatch: int = 512
    """The upstream's `-ub` (llama-server does not report it): where a prompt sent whole ends its
    last micro-batch, trimmed when that is under 64 rows (`trim_short_turns`)."""
    max_cold_factor: float = 2.0
    """chunk: the cold request should take at most this × its time alone (as the fitted batch cost
    predicts it); the pauses between pieces shrink when it falls behind. 0: no such bound."""
    background_purposes: tuple[str, ...] = ()
    """`X-Slotwise-Purpose` values of background jobs (e.g. "translation"). chunk: while others
    generate, one is fed in pieces whenever sent whole it would stall them over 2 × `max_stall_ms`,
    while slots are to spare; its own client waits longer so that nobody's reply freezes (a chat
    turn: over 8 ×, from 512 new tokens). With every slot taken (any mode but off, or keep_kv on)
    it lets the chat turns have a freed slot first until it has waited `max_hold_s`."""

    trim_short_turns: bool = True
    """Any mode but off: a turn of under 64 new tokens after a long cached history, on a server
    that computes so few rows one at a time (llama-server's flash attention on a CPU: learned from
    the requests that did), computes again as many of its cached tokens as make 64 in one tile:
    a trim piece first (docs/prefill.md). So does a longer prompt sent whole whose last
    micro-batch (`n_ubatch`) would hold under 64 rows."""
    learned_file: str = ""
    """A file where slotwise keeps what it measured of its llama-server across its own restarts
    (the batch cost, the row-by-row price, how much of a reply follow-ups find), for the same
    model, build, slots and n_batch; empty: learned again after each start. Read at start."""

    def is_background(self, purpose: str | None) -> bool:
        """Whether a request with this `X-Slotwise-Purpose` is a background job."""
        return purpose is not None and purpose in self.background_purposes


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
    """Admin endpoints every client may call, e.g. "GET /slots" (valid: config/admin_endpoints.py)."""
    pages: PagesMode = "auto"
    """slotwise's /metrics and /slotwise/: open, token (pages_token or admin_key), off; auto: token
    if either is set, else open on a loopback listen address, else off."""
    pages_token: str = field(default="", repr=False)
    """The token for the pages (`Authorization: Bearer TOKEN`, or the password of Basic auth)."""
    pages_token_file: str = ""
    """A file holding the pages token (instead of `pages_token`)."""
    cache_scope: CacheScope = "client"
    """With client keys: `client`, each client's kept KV files and warm-up answers are its own (a
    client learns nothing of another's prompts through them); `shared`: one pool for all clients,
    on purpose (a team that shares its system prompts and histories)."""

    @property
    def isolates_caches(self) -> bool:
        """Whether kept KV and warm-ups are partitioned by client (client keys and scope `client`)."""
        return bool(self.clients) and self.cache_scope == "client"


@dataclass(frozen=True)
class ClusterConfig:
    node: str = ""
    """This node's name behind a router: the `X-Slotwise-Node` response header and the record's
    `node`; "" = HOSTNAME:PORT (the configured port)."""
    load_format: LoadFormat = "vllm"
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
    llama-server's --slot-save-path (any [prefill] mode: the prompt is estimated for it)."""
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
    max_wait_s: float = 60.0
    """A returning conversation waits at most this long for a slot to restore its file into (the
    next slot to come free is claimed for it); then it is computed."""


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


NODE_NAME = re.compile(r"^[A-Za-z0-9._:@-]{1,64}$")
