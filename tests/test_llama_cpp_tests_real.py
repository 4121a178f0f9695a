"""llama.cpp's own server tests (tools/server/tests of the b11434 source the testbed builds) that once
gave another result through slotwise than direct, run both ways against the real server: what they
send, and what they assert, compared."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import http as call
from tests.helpers import read_records

pytestmark = pytest.mark.real_server

API_KEY = "sk-this-is-the-secret-key"  # test_security.py's
STATIC_PATHS = ("/", "/sw.js", "/manifest.webmanifest", "/_app/version.json")
"""test_access_static_assets_without_api_key's paths (each wants 200 from a build with its UI)."""


class NoContent(BaseHTTPRequestHandler):
    """test_proxy.py's target of test_mcp_proxy_no_content: every POST is answered 204."""

    def do_POST(self) -> None:
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def no_content_target() -> Iterator[str]:
    target = ThreadingHTTPServer(("127.0.0.1", 0), NoContent)
    threading.Thread(target=target.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{target.server_port}/"
    finally:
        target.shutdown()
        target.server_close()


async def test_mcp_proxy_no_content_is_a_204_through_slotwise_as_direct(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy) -> None:
    """llama.cpp's test_mcp_proxy_no_content: `POST /cors-proxy?url=<a 204 target>` with `{}` is
    204 with no body. llama-server relays the 204 as a chunked stream; slotwise answered 500."""
    server = start_llama_server(args=["--ui-mcp-proxy"])
    proxy = await asyncio.to_thread(start_proxy, server.url, access={"allow": ["POST /cors-proxy"]})
    with no_content_target() as target:
        # Python's http.client, as llama.cpp's own test (requests): it reads a 204 as its head
        # alone; aiohttp's client, direct, fails on the stray terminator when it comes in the same
        # read (the very defect slotwise's connector handles for its own upstream calls).
        for base in (server.url, proxy.url, proxy.url):  # slotwise twice: a pooled connection
            reply = await asyncio.to_thread(call, "POST", f"{base}/cors-proxy?url={target}", {})
            assert (base, reply.status_code, reply.content) == (base, 204, b"")
    await asyncio.to_thread(proxy.stop)
    assert [(r["status"], r["outcome"]) for r in read_records(proxy)] == [(204, "done")] * 2


@pytest.mark.parametrize("ui", ["built-in", "path"], ids=["built-in-ui", "ui-from-path"])
async def test_access_static_assets_without_api_key_as_direct(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, tmp_path: Path,
        ui: str) -> None:
    """llama.cpp's test_access_static_assets_without_api_key: with `--api-key`, `/` and the web UI's
    files answer without a key. Which files a build embeds is its own (this testbed's build has
    none: its UI could not be downloaded, so llama-server itself answers 404 and 401 there; with
    `--path` it serves a directory, `/` without a key); slotwise answered 401 to all of them. Now
    every path answers through slotwise exactly as direct, with `[upstream] api_key`."""
    args = ["--api-key", API_KEY]
    if ui == "path":
        for name in ("index.html", "sw.js", "manifest.webmanifest", "_app/version.json"):
            (tmp_path / "ui" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "ui" / name).write_text(f"the file {name}")
        args += ["--path", str(tmp_path / "ui")]
    server = start_llama_server(args=args)
    proxy = await asyncio.to_thread(start_proxy, server.url, upstream={"api_key": API_KEY})
    async with aiohttp.ClientSession() as session:
        for path in (*STATIC_PATHS, "/props", "/v1/models", "/health"):
            async with session.get(server.url + path) as direct, \
                    session.get(proxy.url + path) as proxied:
                assert (path, proxied.status) == (path, direct.status)
                assert await proxied.read() == await direct.read() or proxied.status == 401
    await asyncio.to_thread(proxy.stop)
