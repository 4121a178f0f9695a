"""Shared fixtures: the proxy (`start_proxy`, and `proxy` in front of a module's `upstream_url`),
the fake upstream on loopback (`fake_url`), and for tests that run the real llama-server the
binary, the testbed models and a factory that starts servers on 127.0.0.1. Whatever a fixture
starts is stopped when the test ends."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest

from proxy.config import Config
from proxy.runner import ProxyThread
from proxy.testbed.binary import BinaryError, find_llama_server
from proxy.testbed.model import ModelFiles, write_model
from proxy.testbed.server import LlamaServer
from tests.fake_upstream import make_app
from tests.helpers import proxy_config, serve_app

pytest_plugins = ["tests.served"]  # the `serving` fixture of the operations tests


class StartLlamaServer(Protocol):
    """The type of the `start_llama_server` fixture, for annotating tests."""

    def __call__(
        self, model: ModelFiles | Path | None = None, *, lora: bool | Path = True, args: Sequence[str] = ()
    ) -> LlamaServer: ...


@pytest.fixture(scope="session")
def llama_server_binary(pytestconfig: pytest.Config) -> Path:
    """The llama-server binary; builds it on first use (minutes), with progress shown live."""
    # A first build takes minutes: let its progress lines through pytest's output capture.
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    uncaptured = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    try:
        with uncaptured:
            return find_llama_server()
    except BinaryError as exc:
        pytest.fail(f"no llama-server for the real-server tests: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    """The fast testbed model (embd 256, 4 layers) and its LoRA adapter, seed 0."""
    return write_model(tmp_path_factory.mktemp("tiny-model"), "tiny", seed=0)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    """The contention-benchmark model (embd 768, 8 layers, ~126 MB), seed 0."""
    return write_model(tmp_path_factory.mktemp("small-model"), "small", seed=0)


@pytest.fixture
def start_llama_server(
    request: pytest.FixtureRequest, llama_server_binary: Path, tmp_path: Path
) -> Iterator[StartLlamaServer]:
    """`start_llama_server(model=None, *, lora=True, args=())` -> a started LlamaServer.

    `model` is ModelFiles (default: the tiny model) or a bare .gguf path; `lora=True` loads the
    model's testbed adapter (none for a bare path), False loads none, a Path loads that file.
    `args` go to llama-server as they are. Every server started is stopped at teardown.
    """
    servers: list[LlamaServer] = []

    def start(
        model: ModelFiles | Path | None = None,
        *,
        lora: bool | Path = True,
        args: Sequence[str] = (),
    ) -> LlamaServer:
        files = model if model is not None else request.getfixturevalue("tiny_model")
        server = LlamaServer(
            files.model if isinstance(files, ModelFiles) else Path(files),
            lora=_adapter(files, lora),
            args=args,
            binary=llama_server_binary,
            log_path=tmp_path / f"llama-server-{len(servers)}.log",
        )
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def _adapter(model: ModelFiles | Path, lora: bool | Path) -> Path | None:
    if isinstance(lora, Path):
        return lora
    if lora and isinstance(model, ModelFiles):
        return model.lora
    return None


class StartProxy(Protocol):
    """The type of the `start_proxy` fixture, for annotating tests."""

    def __call__(self, upstream: str | Config, /, **tables: Any) -> ProxyThread: ...


@pytest.fixture
def start_proxy(tmp_path: Path) -> Iterator[StartProxy]:
    """`start_proxy(upstream_url, **tables)` -> a proxy serving in its own thread, its config made
    by `helpers.proxy_config` (timing log in tmp_path; `tables` add to it); or `start_proxy(config)`.

    Every proxy started is stopped at teardown, also one that failed to start. From an async test
    whose upstream runs on the test's loop, call it with `asyncio.to_thread` when the proxy talks to
    the upstream as it starts (LoRA modes fixed and none).
    """
    started: list[ProxyThread] = []

    def start(upstream: str | Config, /, **tables: Any) -> ProxyThread:
        if isinstance(upstream, Config):
            config = upstream
        else:  # one timing log per proxy
            log_dir = tmp_path / f"proxy-{len(started)}" if started else tmp_path
            config = proxy_config(upstream, log_dir, **tables)
        proxy = ProxyThread(config)
        started.append(proxy)
        return proxy.__enter__()

    try:
        yield start
    finally:
        for proxy in started:
            proxy.stop()


@pytest.fixture
async def fake_url() -> AsyncIterator[str]:
    """The fake upstream (tests/fake_upstream.py) on 127.0.0.1: its URL."""
    async with serve_app(make_app()) as url:
        yield url


@pytest.fixture
def proxy_tables() -> dict[str, Any]:
    """Config tables of the `proxy` fixture (`prefill`, `listen`, …); a module may override it."""
    return {}


@pytest.fixture
def proxy(start_proxy: StartProxy, upstream_url: str, proxy_tables: dict[str, Any]) -> ProxyThread:
    """A running proxy in front of `upstream_url`, a fixture each module that uses this defines."""
    return start_proxy(upstream_url, **proxy_tables)
