"""The parsers of the feature tables: [cluster], [warm], [keep_kv]."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proxy.config.fields import check_keys, choice, flag, number, string
from proxy.config.values import (
    LOAD_FORMATS,
    NODE_NAME,
    ClusterConfig,
    ConfigError,
    KeepKvConfig,
    WarmConfig,
)


def cluster_table(data: Mapping[str, Any]) -> ClusterConfig:
    check_keys(data, "cluster.", ClusterConfig)
    d = ClusterConfig()
    node = string(data, "node", "cluster.node", d.node)
    if node and not NODE_NAME.match(node):
        raise ConfigError(f"cluster.node: {node!r} is not a name for a header (valid: 1 to 64 "
                          "letters, digits and . _ : @ -, e.g. 'gpu-box-1')")
    return ClusterConfig(
        node=node,
        load_format=choice(data, "load_format", "cluster.load_format", d.load_format, LOAD_FORMATS),
        health_timeout_s=number(data, "health_timeout_s", "cluster.health_timeout_s",
                                 d.health_timeout_s, low=0.05, high=60),
    )


def warm_table(data: Mapping[str, Any]) -> WarmConfig:
    check_keys(data, "warm.", WarmConfig)
    d = WarmConfig()
    enabled = flag(data, "enabled", "warm.enabled", d.enabled)
    return WarmConfig(
        enabled=enabled,
        max_pending=number(data, "max_pending", "warm.max_pending", d.max_pending,
                            low=1, high=10_000, integer=True),
        max_tokens=number(data, "max_tokens", "warm.max_tokens", d.max_tokens,
                           low=64, high=10_000_000, integer=True),
        expire_s=number(data, "expire_s", "warm.expire_s", d.expire_s, low=1, high=86400),
        max_per_client=number(data, "max_per_client", "warm.max_per_client", d.max_per_client,
                               low=1, high=10_000, integer=True),
    )


# ---- [keep_kv] (proxy/keep, docs/keep-kv.md) ----------------------------------------------------

def keep_kv_table(data: Mapping[str, Any]) -> KeepKvConfig:
    check_keys(data, "keep_kv.", KeepKvConfig)
    d = KeepKvConfig()
    enabled = flag(data, "enabled", "keep_kv.enabled", d.enabled)
    directory = string(data, "dir", "keep_kv.dir", d.dir)
    if enabled:
        _keep_kv_needs(directory)
    return KeepKvConfig(
        enabled=enabled, dir=directory,
        save_after_idle_s=number(data, "save_after_idle_s", "keep_kv.save_after_idle_s",
                                  d.save_after_idle_s, low=1, high=7 * 86400),
        max_disk_gb=number(data, "max_disk_gb", "keep_kv.max_disk_gb", d.max_disk_gb,
                            low=0.001, high=1_000_000),
        max_files=number(data, "max_files", "keep_kv.max_files", d.max_files,
                          low=1, high=100_000, integer=True),
        max_age_days=number(data, "max_age_days", "keep_kv.max_age_days", d.max_age_days,
                             low=0.001, high=3650),
        min_tokens=number(data, "min_tokens", "keep_kv.min_tokens", d.min_tokens,
                           low=64, high=10_000_000, integer=True),
        max_wait_s=number(data, "max_wait_s", "keep_kv.max_wait_s", d.max_wait_s,
                          low=0, high=3600),
    )


def _keep_kv_needs(directory: str) -> None:
    """What an enabled [keep_kv] needs: a directory that exists."""
    if not directory:
        raise ConfigError("keep_kv.dir: must name a directory when keep_kv.enabled is true (valid: "
                          "the directory llama-server was given as --slot-save-path)")
    if not Path(directory).is_dir():
        raise ConfigError(f"keep_kv.dir: {directory!r} is not a directory (valid: the directory "
                          "llama-server was given as --slot-save-path)")
