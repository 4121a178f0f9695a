"""`[upstream] api_key`: slotwise's own calls to a keyed llama-server carry the key (from the config
in force, so a reload applies); a client must present that key itself, and slotwise checks it before
it does any work for the request. A fake upstream that answers 401 without the key, quick."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.runner import ProxyThread
from tests.conftest import StartProxy
from tests.helpers import read_records, serve_app

KEY = "k-one"
PAGES = {"Authorization": "Bearer page-token"}


def answer(data: Any) -> Any:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(data)
    return handler


class KeyedUpstream:
    """Answers like llama-server with `--api-key`; records (method, path, Authorization)."""

    def __init__(self) -> None:
        self.key = KEY
        self.seen: list[tuple[str, str, str | None]] = []

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_get("/health", answer({"status": "ok"}))
        app.router.add_get("/lora-adapters", answer([{"id": 0, "path": "style.gguf", "scale": 0.0}]))
        app.router.add_post("/lora-adapters", answer({"success": True}))
        app.router.add_get("/props", answer({"total_slots": 2,
                                             "default_generation_settings": {"n_ctx": 4096}}))
        app.router.add_post("/apply-template", answer({"prompt": "a b c"}))
        app.router.add_post("/tokenize", answer({"tokens": [1, 2, 3]}))
        app.router.add_get("/slots", answer([{"id": 0, "is_processing": False}]))
        app.router.add_post("/v1/chat/completions", answer(
            {"choices": [{"message": {"content": "hi"}}], "timings": {"prompt_n": 3, "cache_n": 0}}))
        return app

    @web.middleware
    async def auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization")
        self.seen.append((request.method, request.path, given))
        if request.path not in ("/health", "/v1/chat/completions") and \
                given != f"Bearer {self.key}":
            return web.json_response({"error": {"code": 401, "message": "Invalid API Key"}},
                                     status=401)
        response: web.StreamResponse = await handler(request)
        return response

    def auth_of(self, method: str, path: str) -> list[str | None]:
        return [a for m, p, a in self.seen if (m, p) == (method, path)]


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[KeyedUpstream, str]]:
    fake = KeyedUpstream()
    async with serve_app(fake.app()) as url:
        yield fake, url


async def chat(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
               text: str = "hello") -> int:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        await response.read()
        return response.status


async def status_slots(session: aiohttp.ClientSession, proxy: ProxyThread) -> list[Any]:
    """The slots the status page shows, once its background /slots poll has answered."""
    deadline = time.monotonic() + 5
    while True:
        async with session.get(proxy.url + "/slotwise/status", headers=PAGES) as response:
            status = await response.json()
        if status["slots"]["slots"] or time.monotonic() > deadline:
            assert status["config"]["upstream"]["api_key"] == "***"
            return list(status["slots"]["slots"])
        await asyncio.sleep(0.05)


async def test_own_calls_carry_the_key_and_clients_must_present_it(
        upstream: tuple[KeyedUpstream, str], start_proxy: StartProxy) -> None:
    fake, url = upstream
    proxy = await asyncio.to_thread(
        start_proxy, url, upstream={"api_key": KEY}, access={"pages_token": "page-token"},
        lora={"mode": "fixed", "adapters": [{"id": 0, "scale": 1.0}]},
        prefill={"mode": "chunk", "cold_tokens": 2})
    async with aiohttp.ClientSession() as session:
        assert await chat(session, proxy.url, {}) == 401  # checked by slotwise, before any work
        assert await chat(session, proxy.url, {"Authorization": "Bearer the-clients-own"}) == 401
        assert not {p for _, p, _ in fake.seen} & {"/apply-template", "/tokenize", "/v1/chat/completions"}
        assert await chat(session, proxy.url, {"Authorization": f"Bearer {KEY}"}) == 200
        assert await chat(session, proxy.url, {"x-api-key": KEY}) == 200  # Anthropic-style
        records = await asyncio.to_thread(read_records, proxy, 4)
        assert [r["outcome"] for r in records] == ["unauthorized"] * 2 + ["done"] * 2
        assert all(r["est_prompt_tokens"] == 3 and r["lora_rewritten"] for r in records[2:])
        assert await status_slots(session, proxy)
        for call in [("GET", "/lora-adapters"), ("POST", "/lora-adapters"),
                     ("GET", "/props"), ("POST", "/apply-template"), ("POST", "/tokenize"),
                     ("GET", "/slots")]:
            assert set(fake.auth_of(*call)) == {f"Bearer {KEY}"}, call
        # Forwarded with the key in force as `Authorization` (the client's x-api-key swapped).
        assert fake.auth_of("POST", "/v1/chat/completions") == [f"Bearer {KEY}"] * 2

        # A reload with another key: the next own calls carry the new one.
        fake.key = "k-two"
        old = proxy.state.config
        new = dataclasses.replace(old, upstream=dataclasses.replace(old.upstream,
                                                                    api_key="k-two"))
        await asyncio.to_thread(proxy.call, proxy.state.apply_config(new))
        fake.seen.clear()
        assert await chat(session, proxy.url, {"Authorization": f"Bearer {KEY}"}) == 401
        # (another body: the same one's token ids are remembered, no /apply-template asked)
        assert await chat(session, proxy.url, {"Authorization": "Bearer k-two"}, "hi again") == 200
        assert set(fake.auth_of("POST", "/apply-template")) == {"Bearer k-two"}
        assert fake.auth_of("GET", "/lora-adapters") in ([], ["Bearer k-two"])
        assert (await asyncio.to_thread(read_records, proxy, 6))[-1]["est_prompt_tokens"] == 3
    await asyncio.to_thread(proxy.stop)  # on this loop's side: the fake upstream must answer


class WebUiServer:
    """Answers like llama-server with `--api-key` and a web UI built in: its key check lets pass
    `/health`, `/v1/health`, `/` and each embedded file (tools/server/server-http.cpp,
    `get_public_endpoints`); everything else wants the key. Records each request's credentials."""

    FILES = ("/sw.js", "/manifest.webmanifest", "/_app/version.json", "/_app/immutable/app.3f9a.js")

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, bool]] = []
        """(path, credentials, came through slotwise)"""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        for path in ("/", "/index.html", *self.FILES):
            app.router.add_get(path, answer({"file": path}))
        app.router.add_get("/props", answer({"total_slots": 2}))
        app.router.add_get("/v1/models", answer({"data": []}))
        return app

    @web.middleware
    async def auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization") or request.headers.get("X-Api-Key")
        self.seen.append((request.path, given, "X-Forwarded-For" in request.headers))
        public = {"/health", "/v1/health", "/", "/index.html", *self.FILES}
        if request.path not in public and given != f"Bearer {KEY}":
            return web.json_response({"error": {"code": 401, "message": "Invalid API Key",
                                                "type": "authentication_error"}}, status=401)
        response: web.StreamResponse = await handler(request)
        return response


UI_PATHS = ("/", "/index.html", *WebUiServer.FILES, "/secret.txt", "/props", "/v1/models",
            "/props/x.js")


@pytest.mark.parametrize("access", [{}, {"clients": [{"name": "alice", "key": "alice-key"}]}],
                         ids=["upstream-key", "client-keys"])
async def test_the_web_ui_loads_without_a_key_exactly_as_llama_server_serves_it(
        start_proxy: StartProxy, access: dict[str, Any]) -> None:
    server = WebUiServer()
    async with serve_app(server.app()) as url, aiohttp.ClientSession() as session:
        proxy = await asyncio.to_thread(start_proxy, url, upstream={"api_key": KEY}, access=access)
        for path in UI_PATHS:  # keyless, and with a key the server does not know
            for headers in ({}, {"Authorization": "Bearer guess"}):
                async with session.get(url + path, headers=headers) as direct, \
                        session.get(proxy.url + path, headers=headers) as proxied:
                    assert (proxied.status, path) == (direct.status, path)
                    if direct.status == 200:
                        assert await proxied.json() == await direct.json()
        # llama-server's own check decided: what went up from slotwise carried no key at all (not
        # the server's), and the API routes were refused by slotwise itself, before going up
        through = {(path, given) for path, given, proxied in server.seen if proxied}
        assert through == {(path, None) for path in UI_PATHS[:-3]}
    await asyncio.to_thread(proxy.stop)
    records = await asyncio.to_thread(read_records, proxy)
    refused = {r["endpoint"] for r in records if r["outcome"] == "unauthorized"}
    assert refused - {None} == {"/props", "/v1/models", "/props/x.js"}  # None: the 6th's summary


@pytest.mark.parametrize("tables", [
    {"access": {"clients": [{"name": "router", "key": "router-key"}], "pages_token": "page-token"}},
    {"upstream": {"api_key": KEY}, "access": {"pages_token": "page-token"}}],
    ids=["client-keys", "upstream-key"])
async def test_with_keys_the_load_needs_one_and_health_stays_public_as_llama_server_s(
        upstream: tuple[KeyedUpstream, str], start_proxy: StartProxy, tables: dict[str, Any]) -> None:
    """llama-server answers /health to anyone even with --api-key (its `get_public_endpoints`), and
    a router's health check sends no key: so does slotwise. /get_load is slotwise's own and tells how
    busy the node is, and whose requests are held: with keys on, a key (the router's) or the pages
    token, like the pages."""
    _, url = upstream
    key = "router-key" if "clients" in tables["access"] else KEY
    proxy = await asyncio.to_thread(start_proxy, url, **tables)
    async with aiohttp.ClientSession() as session:
        async with session.get(proxy.url + "/health") as response:
            assert response.status == 200
        for headers in ({}, {"Authorization": "Bearer guess"}):
            async with session.get(proxy.url + "/get_load", headers=headers) as response:
                assert response.status == 401
                assert response.headers["X-Slotwise-Error"] == "authentication_error"
                assert "/get_load" in (await response.json())["error"]["message"]
        for given in (key, "page-token"):
            async with session.get(proxy.url + "/get_load",
                                   headers={"Authorization": f"Bearer {given}"}) as response:
                assert response.status == 200 and "load" in await response.json()
    await asyncio.to_thread(proxy.stop)


async def test_without_keys_the_load_is_open(
        upstream: tuple[KeyedUpstream, str], start_proxy: StartProxy) -> None:
    _, url = upstream
    proxy = await asyncio.to_thread(start_proxy, url)
    async with aiohttp.ClientSession() as session, session.get(proxy.url + "/get_load") as response:
        assert response.status == 200
    await asyncio.to_thread(proxy.stop)
