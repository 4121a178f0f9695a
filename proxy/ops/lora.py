"""The LoRA profile, pure: the one explicit `lora` array every request gets in modes fixed and none,
built from the `[lora]` config and the adapter list the server reports (`GET /lora-adapters`), and
the clear errors for a config that does not fit that server. No I/O here: see `proxy.ops.lora_watch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.config import ConfigError, LoraAdapter, LoraConfig
from proxy.request.errors import LoraNotReady

LoraArray = list[dict[str, Any]]


class LoraConfigError(ConfigError):
    """The `[lora]` config names adapters the server does not have (stops a start, refuses a reload)."""


class LoraListError(ValueError):
    """The server's `GET /lora-adapters` answer is not the list slotwise expects."""


@dataclass(frozen=True)
class ServerAdapter:
    id: int
    path: str
    """The path the server was given (`--lora PATH`), as it reports it."""
    scale: float = field(default=1.0, compare=False)
    """The server's global scale: used by requests without an explicit `lora` (not compared)."""

    @property
    def file_name(self) -> str:
        return self.path.replace("\\", "/").rsplit("/", 1)[-1]

    def describe(self) -> str:
        return f"id {self.id} {self.file_name!r}"


def parse_server_adapters(data: Any) -> tuple[ServerAdapter, ...]:
    """The adapters in a `GET /lora-adapters` answer, in id order."""
    if not isinstance(data, list):
        raise LoraListError(f"expected a JSON array of adapters, got a JSON {type(data).__name__}")
    adapters = []
    for i, item in enumerate(data):
        ok = (isinstance(item, dict) and isinstance(item.get("id"), int)
              and not isinstance(item.get("id"), bool) and isinstance(item.get("path"), str))
        if not ok:
            raise LoraListError(f"item {i} is not an object with an integer 'id' and a string "
                                f"'path': {str(item)[:200]}")
        scale = item.get("scale", 1.0)
        scale = float(scale) if isinstance(scale, int | float) else 1.0
        adapters.append(ServerAdapter(id=item["id"], path=item["path"], scale=scale))
    return tuple(sorted(adapters, key=lambda a: a.id))


def needs_server(config: LoraConfig) -> bool:
    """Whether the mode needs the server's adapter list (everything but passthrough)."""
    return config.mode != "passthrough"


def build_lora_array(config: LoraConfig, server: Sequence[ServerAdapter],
                     where: str = "the llama-server") -> LoraArray | None:
    """The array every model request is forwarded with, or None to forward what the client sent.

    Every loaded adapter is listed, in id order, those the config does not name at scale 0.0: the
    array must be identical for every request, or the server cannot batch them and may reuse KV made
    under other adapters. With no adapter loaded, mode none forwards nothing: an empty array would
    mean "the server's global list" to llama-server, and there is nothing to switch anyway.
    """
    if config.mode == "passthrough":
        return None
    if not server:
        if config.mode == "fixed":
            raise LoraConfigError(
                f"lora.mode: 'fixed' needs LoRA adapters loaded in llama-server, but {where} has "
                "none (valid: start llama-server with --lora FILE, or use mode 'none' or "
                "'passthrough')")
        return None
    scales = _configured_scales(config, server, where) if config.mode == "fixed" else {}
    return [{"id": a.id, "scale": scales.get(a.id, 0.0)} for a in server]


def global_differs(array: LoraArray, server: Sequence[ServerAdapter]) -> bool:
    """Whether the server's global scales differ from the profile. Requests that reach the model
    without an explicit array (`/v1/messages` drops `lora`; clients that bypass slotwise) use the
    global scales, so those must equal the profile too."""
    wanted = {entry["id"]: entry["scale"] for entry in array}
    return any(abs(a.scale - wanted.get(a.id, 0.0)) > 1e-4 for a in server)


def _configured_scales(config: LoraConfig, server: Sequence[ServerAdapter],
                       where: str) -> dict[int, float]:
    scales: dict[int, float] = {}
    named_by: dict[int, str] = {}
    for i, adapter in enumerate(config.adapters):
        dotted = f"lora.adapters[{i}]"
        found = find_adapter(adapter, server, dotted, where)
        if found.id in named_by:
            raise LoraConfigError(
                f"{dotted}: names {found.describe()} again, as {named_by[found.id]} does "
                "(valid: each adapter once)")
        named_by[found.id] = dotted
        scales[found.id] = adapter.scale
    return scales


def find_adapter(adapter: LoraAdapter, server: Sequence[ServerAdapter], dotted: str,
                 where: str = "the llama-server") -> ServerAdapter:
    """The loaded adapter a config entry names: by id, by the exact path, else by file name."""
    loaded = _loaded(server)
    if adapter.id is not None:
        for candidate in server:
            if candidate.id == adapter.id:
                return candidate
        raise LoraConfigError(f"{dotted}.id: {adapter.id} is not loaded in {where} "
                              f"(valid: {loaded})")
    name = adapter.name or ""
    exact = [a for a in server if a.path == name]
    matches = exact or [a for a in server if a.file_name == name.replace("\\", "/")]
    if not matches:
        raise LoraConfigError(f"{dotted}.name: {name!r} is not loaded in {where} (valid: {loaded})")
    if len(matches) > 1:
        paths = ", ".join(f"id {a.id} {a.path!r}" for a in matches)
        raise LoraConfigError(f"{dotted}.name: {name!r} matches several loaded adapters ({paths}); "
                              "name it by its full path or by id")
    return matches[0]


def _loaded(server: Sequence[ServerAdapter]) -> str:
    if not server:
        return "it has no adapters loaded"
    return "it has " + ", ".join(a.describe() for a in server)


_CacheKey = tuple[LoraConfig, str, tuple[ServerAdapter, ...]]


class LoraProfile:
    """What slotwise knows of the upstream's adapters, and the array each config gets from it.

    The list is kept when the upstream cannot be read for a while (a request then fails on its own
    way upstream); it is replaced by every successful read. Arrays are cached per (config, list).
    """

    def __init__(self) -> None:
        self.url: str | None = None
        self.server: tuple[ServerAdapter, ...] | None = None
        self.problem = "slotwise has not read GET /lora-adapters from the upstream yet"
        self._arrays: dict[_CacheKey, LoraArray | LoraConfigError | None] = {}

    def update(self, url: str, server: tuple[ServerAdapter, ...]) -> bool:
        """Record a successful read; True if the list (or the upstream) differs from the last."""
        changed = (url, server) != (self.url, self.server)
        self.url, self.server, self.problem = url, server, ""
        return changed

    def unreadable(self, problem: str) -> None:
        self.problem = problem

    def known(self, url: str) -> tuple[ServerAdapter, ...] | None:
        return self.server if url == self.url else None

    def array(self, lora: LoraConfig, url: str,
              server: tuple[ServerAdapter, ...]) -> LoraArray | None:
        """`build_lora_array`, cached; raises LoraConfigError when the config does not fit."""
        key = (lora, url, server)
        if key not in self._arrays:
            if len(self._arrays) > 16:
                self._arrays.clear()
            try:
                self._arrays[key] = build_lora_array(lora, server, f"the llama-server at {url}")
            except LoraConfigError as exc:
                self._arrays[key] = exc
        result = self._arrays[key]
        if isinstance(result, LoraConfigError):
            raise result
        return result

    def forced(self, lora: LoraConfig, url: str) -> LoraArray | None:
        """The array a model request gets now (a fresh copy), None in passthrough; raises
        LoraNotReady when it cannot be built."""
        if not needs_server(lora):
            return None
        server = self.known(url)
        if server is None:
            raise LoraNotReady(f"lora.mode {lora.mode!r}: the LoRA profile is not ready, so the "
                               f"request was not forwarded: {self.problem}")
        try:
            result = self.array(lora, url, server)
        except LoraConfigError as exc:
            raise LoraNotReady(f"{exc}; model requests are refused until the config or the "
                               "server is fixed") from exc
        return None if result is None else [dict(entry) for entry in result]
