"""The LoRA profile against a fake upstream on loopback: the first read at start, an upstream that
is down or comes back with other adapters, reload checks, and the bodies the upstream receives."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.app import start
from proxy.config import Config, ConfigError, parse_config
from proxy.ops.lora import LoraConfigError, LoraProfile
from proxy.ops.lora_watch import check_reload, first_read, refresh
from proxy.record.timing_log import TimingLog
from proxy.request.errors import LoraNotReady
from proxy.state import ProxyState
from tests.conftest import StartProxy
from tests.helpers import read_records, serve_app


@dataclass
class Fake:
    adapters: list[dict[str, Any]] = field(default_factory=lambda: [
        {"id": 0, "path": "/m/style.gguf", "scale": 1.0},
        {"id": 1, "path": "/m/lang-de.gguf", "scale": 1.0}])
    status: int = 200
    bodies: list[dict[str, Any]] = field(default_factory=list)
    posted: list[Any] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/lora-adapters", self.lora_adapters)
        app.router.add_post("/lora-adapters", self.set_scales)
        app.router.add_get("/health", self.health)
        app.router.add_post("/completion", self.completion)
        app.router.add_post("/v1/chat/completions", self.completion)
        return app

    async def lora_adapters(self, request: web.Request) -> web.Response:
        return web.json_response(self.adapters, status=self.status)

    async def set_scales(self, request: web.Request) -> web.Response:
        self.posted.append(await request.json())
        scales = {entry["id"]: entry["scale"] for entry in self.posted[-1]}
        for adapter in self.adapters:
            adapter["scale"] = scales.get(adapter["id"], 0.0)
        return web.json_response({"success": True})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def completion(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return web.json_response({"content": "ok"})


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Fake, str]]:
    upstream = Fake()
    async with serve_app(upstream.app()) as url:
        yield upstream, url


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def make_config(url: str, tmp_path: Path, **lora: Any) -> Config:
    return parse_config({"upstream": {"url": url, "connect_timeout_s": 1},
                         "listen": {"port": 0},
                         "log": {"timing": str(tmp_path / "timing.jsonl")}, "lora": lora})


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


MakeState = Callable[[Config, aiohttp.ClientSession], ProxyState]


@pytest.fixture
def make_state() -> Iterator[MakeState]:
    made: list[ProxyState] = []

    def make(config: Config, session: aiohttp.ClientSession) -> ProxyState:
        made.append(ProxyState(config=config, timing_log=TimingLog(config.log.timing),
                               session=session))
        return made[-1]

    yield make
    for state in made:
        state.timing_log.close()



FIXED_DE = {"mode": "fixed", "adapters": [{"name": "lang-de.gguf", "scale": 0.5}]}


async def test_first_read_resolves_names_to_ids(fake: tuple[Fake, str], tmp_path: Path,
                                                session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    _, url = fake
    state, profile = make_state(make_config(url, tmp_path, **FIXED_DE), session), LoraProfile()
    await first_read(state, profile)
    assert profile.forced(state.config.lora, url) == [{"id": 0, "scale": 0.0},
                                                      {"id": 1, "scale": 0.5}]


async def test_the_global_scales_are_set_to_the_profile_once(
        fake: tuple[Fake, str], tmp_path: Path, session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    upstream, url = fake
    state, profile = make_state(make_config(url, tmp_path, **FIXED_DE), session), LoraProfile()
    await first_read(state, profile)
    assert await refresh(state, profile)
    assert upstream.posted == [[{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]]
    upstream.adapters[1]["scale"] = 1.0  # somebody else changed them
    assert await refresh(state, profile)
    assert len(upstream.posted) == 2


async def test_passthrough_leaves_the_global_scales_alone(
        fake: tuple[Fake, str], tmp_path: Path, session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    upstream, url = fake
    await first_read(make_state(make_config(url, tmp_path), session), LoraProfile())
    assert upstream.posted == []


async def test_first_read_stops_the_start_on_a_name_the_server_lacks(
        fake: tuple[Fake, str], tmp_path: Path, session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    _, url = fake
    config = make_config(url, tmp_path, mode="fixed", adapters=[{"name": "styel.gguf"}])
    with pytest.raises(LoraConfigError) as caught:
        await first_read(make_state(config, session), LoraProfile())
    assert str(caught.value) == (
        f"lora.adapters[0].name: 'styel.gguf' is not loaded in the llama-server at {url} "
        "(valid: it has id 0 'style.gguf', id 1 'lang-de.gguf')")


async def test_first_read_stops_fixed_on_a_server_without_adapters(
        fake: tuple[Fake, str], tmp_path: Path, session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    upstream, url = fake
    upstream.adapters = []
    config = make_config(url, tmp_path, mode="fixed", adapters=[{"id": 0}])
    with pytest.raises(LoraConfigError, match="'fixed' needs LoRA adapters loaded in llama-server"):
        await first_read(make_state(config, session), LoraProfile())


async def test_first_read_stops_on_an_upstream_that_has_no_adapter_list(
        fake: tuple[Fake, str], tmp_path: Path, session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    upstream, url = fake
    upstream.status = 404
    with pytest.raises(LoraConfigError, match=r"^lora.mode: 'none' needs the upstream's adapter "
                                              r"list, but GET .*/lora-adapters answered HTTP 404"):
        await first_read(make_state(make_config(url, tmp_path, mode="none"), session),
                         LoraProfile())


async def test_an_unreachable_upstream_at_start_is_retried_and_refused_until_read(
        tmp_path: Path, session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    url = closed_port_url()
    state, profile = make_state(make_config(url, tmp_path, mode="none"), session), LoraProfile()
    await first_read(state, profile)  # no error: the server may come up later
    with pytest.raises(LoraNotReady, match=r"cannot read|ClientConnectorError"):
        profile.forced(state.config.lora, url)
    assert await refresh(state, profile) is False


async def test_a_loading_upstream_counts_as_not_ready(fake: tuple[Fake, str], tmp_path: Path,
                                                     session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    upstream, url = fake
    upstream.status = 503
    state, profile = make_state(make_config(url, tmp_path, mode="none"), session), LoraProfile()
    await first_read(state, profile)
    with pytest.raises(LoraNotReady, match="loading"):
        profile.forced(state.config.lora, url)
    upstream.status = 200
    assert await refresh(state, profile) is True
    assert profile.forced(state.config.lora, url) == [{"id": 0, "scale": 0.0},
                                                      {"id": 1, "scale": 0.0}]


async def test_a_restart_with_other_adapters_is_followed(fake: tuple[Fake, str], tmp_path: Path,
                                                         session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    upstream, url = fake
    state, profile = make_state(make_config(url, tmp_path, **FIXED_DE), session), LoraProfile()
    await first_read(state, profile)
    upstream.adapters = [{"id": 0, "path": "/m/lang-de.gguf"}]  # restarted, ids moved
    assert await refresh(state, profile)
    assert profile.forced(state.config.lora, url) == [{"id": 0, "scale": 0.5}]
    upstream.adapters = [{"id": 0, "path": "/m/style.gguf"}]  # restarted without it
    assert await refresh(state, profile)
    with pytest.raises(LoraNotReady, match=r"lora.adapters\[0\].name: 'lang-de.gguf' is not "
                                           r"loaded .* it has id 0 'style.gguf'"):
        profile.forced(state.config.lora, url)


async def test_reload_to_an_adapter_the_server_lacks_is_refused(
        fake: tuple[Fake, str], tmp_path: Path, session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    _, url = fake
    state, profile = make_state(make_config(url, tmp_path), session), LoraProfile()
    bad = make_config(url, tmp_path, mode="fixed", adapters=[{"name": "nope.gguf"}])
    with pytest.raises(ConfigError, match=r"lora.adapters\[0\].name: 'nope.gguf' is not loaded"):
        await check_reload(state, profile, bad)
    good = make_config(url, tmp_path, **FIXED_DE)
    await check_reload(state, profile, good)
    assert profile.forced(good.lora, url) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]


async def test_reload_while_the_upstream_is_down_is_accepted(
        tmp_path: Path, session: aiohttp.ClientSession,
        make_state: MakeState) -> None:
    url = closed_port_url()
    state, profile = make_state(make_config(url, tmp_path), session), LoraProfile()
    await check_reload(state, profile, make_config(url, tmp_path, mode="fixed",
                                                   adapters=[{"name": "whatever.gguf"}]))


# Through the whole proxy.

# The proxy is started off this loop (`to_thread`): the fake upstream must answer its first read.

async def test_fixed_forwards_one_identical_array_whatever_the_client_sent(
        fake: tuple[Fake, str], tmp_path: Path, start_proxy: StartProxy,
        session: aiohttp.ClientSession) -> None:
    upstream, url = fake
    proxy = await asyncio.to_thread(start_proxy, make_config(url, tmp_path, **FIXED_DE))
    sent: list[Any] = [None, [{"id": 0, "scale": 1.0}], "not an array", [{"id": 99}],
                       [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]]
    for lora in sent:
        body: dict[str, Any] = {"prompt": "hi", "n_predict": 1}
        if lora is not None:
            body["lora"] = lora
        async with session.post(proxy.url + "/completion", json=body) as response:
            assert response.status == 200
    proxy.stop()
    expected = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
    assert [b["lora"] for b in upstream.bodies] == [expected] * len(sent)
    recs = read_records(proxy)
    assert [r["lora_in"] for r in recs] == sent
    assert [r["lora_out"] for r in recs] == [expected] * len(sent)
    assert [r["lora_rewritten"] for r in recs] == [True, True, True, True, False]


async def test_passthrough_forwards_a_malformed_lora_unchanged(
        fake: tuple[Fake, str], tmp_path: Path, start_proxy: StartProxy,
        session: aiohttp.ClientSession) -> None:
    upstream, url = fake
    proxy = await asyncio.to_thread(start_proxy, make_config(url, tmp_path))
    async with session.post(proxy.url + "/completion",
                            json={"prompt": "hi", "lora": "not an array"}) as response:
        assert response.status == 200
    assert upstream.bodies == [{"prompt": "hi", "lora": "not an array"}]


async def test_model_requests_get_503_until_the_upstream_can_be_read(
        tmp_path: Path, start_proxy: StartProxy, session: aiohttp.ClientSession) -> None:
    proxy = await asyncio.to_thread(start_proxy,
                                    make_config(closed_port_url(), tmp_path, mode="none"))
    async with session.post(proxy.url + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}]}) as response:
        assert response.status == 503
        assert response.headers["X-Slotwise-Error"] == "slotwise_lora_not_ready"
        message = (await response.json())["error"]["message"]
    assert message.startswith("slotwise: lora.mode 'none': the LoRA profile is not ready")
    async with session.get(proxy.url + "/props") as response:
        assert response.status == 502  # not a model request: forwarded, and the upstream is down
    proxy.stop()
    (rec, _) = read_records(proxy)
    assert rec["status"] == 503 and "not ready" in rec["error"]


async def test_the_proxy_does_not_start_on_a_name_the_server_lacks(
        fake: tuple[Fake, str], tmp_path: Path) -> None:
    _, url = fake
    config = make_config(url, tmp_path, mode="fixed", adapters=[{"name": "x.gguf"}])
    with pytest.raises(LoraConfigError, match=r"'x.gguf' is not loaded .* it has id 0"):
        await start(config)  # which cleans up what it began
