"""The parser of [access]: client keys, the admin key, the pages token, the admin endpoints allowed."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from proxy.config.admin_endpoints import ADMIN_NAMES
from proxy.config.fields import check_keys, choice, secret, show, string
from proxy.config.values import (
    CACHE_SCOPES,
    PAGES_MODES,
    AccessConfig,
    ClientKey,
    ConfigError,
)

CLIENT_NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
ADMIN_CLIENT = "admin"
"""The record's `client` for a request that carried `access.admin_key` (no client may take it)."""


def access_table(data: Mapping[str, Any], upstream_key: str) -> AccessConfig:
    check_keys(data, "access.", AccessConfig)
    raw = data.get("clients", [])
    if not isinstance(raw, list):
        raise ConfigError(f"access.clients: expected an array of tables like "
                          f"{{ name = \"alice\", key_file = \"/etc/slotwise/alice.key\" }}, got {show(raw)}")
    clients = tuple(_client(item, f"access.clients[{i}]") for i, item in enumerate(raw))
    admin_key = secret(data, "admin_key", "access.")
    pages_token = secret(data, "pages_token", "access.")
    _distinct_keys(clients, admin_key, pages_token, upstream_key)
    pages = choice(data, "pages", "access.pages", "auto", PAGES_MODES)
    if pages == "token" and not (pages_token or admin_key):
        raise ConfigError("access.pages: 'token' needs access.pages_token or access.admin_key "
                          "(valid: set one of them, or pages = 'auto', 'open' or 'off')")
    return AccessConfig(
        clients=clients, admin_key=admin_key,
        admin_key_file=string(data, "admin_key_file", "access.admin_key_file", ""),
        allow=_allow(data.get("allow", [])), pages=pages, pages_token=pages_token,
        pages_token_file=string(data, "pages_token_file", "access.pages_token_file", ""),
        cache_scope=choice(data, "cache_scope", "access.cache_scope", "client", CACHE_SCOPES))


def _client(item: Any, dotted: str) -> ClientKey:
    if not isinstance(item, Mapping):
        raise ConfigError(f"{dotted}: expected a table like {{ name = \"alice\", key = \"...\" }}, "
                          f"got {show(item)}")
    check_keys(item, f"{dotted}.", ClientKey)
    name = string(item, "name", f"{dotted}.name", "")
    if not CLIENT_NAME.match(name):
        raise ConfigError(f"{dotted}.name: {name!r} is not a name (valid: 1-64 letters, digits "
                          "and . _ @ -, e.g. 'alice')")
    if name == ADMIN_CLIENT:
        raise ConfigError(f"{dotted}.name: {name!r} is the name of the admin key "
                          "(valid: any other name)")
    key = secret(item, "key", f"{dotted}.")
    if not key:
        raise ConfigError(f"{dotted}: give 'key' (the key itself) or 'key_file' (a file holding it)")
    return ClientKey(name=name, key=key, key_file=string(item, "key_file", f"{dotted}.key_file", ""))


def _distinct_keys(clients: tuple[ClientKey, ...], admin_key: str, pages_token: str,
                   upstream_key: str) -> None:
    """Every name and key names one holder; no client holds the server's key (no key is shown)."""
    names: dict[str, int] = {}
    holders: dict[str, str] = {}
    if upstream_key:
        holders[upstream_key] = "upstream.api_key"
    for held, dotted in ((admin_key, "access.admin_key"), (pages_token, "access.pages_token")):
        if held and held in holders:
            raise ConfigError(f"{dotted}: the same key as {holders[held]} (valid: a key of its own)")
        if held:
            holders[held] = dotted
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
                          f"got {show(raw)}")
    allowed: list[str] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, str):
            raise ConfigError(f"access.allow[{i}]: expected a string like \"GET /slots\", "
                              f"got {show(entry)}")
        method, _, path = entry.strip().partition(" ")
        name = f"{method.upper()} {path.strip()}"
        if name not in ADMIN_NAMES:
            raise ConfigError(f"access.allow[{i}]: {entry!r} is not an admin endpoint "
                              f"(valid: {', '.join(ADMIN_NAMES)})")
        if name not in allowed:
            allowed.append(name)
    return tuple(allowed)
