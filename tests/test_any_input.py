"""A record for every request slotwise answers, whatever its bytes: header values that are not UTF-8,
huge client strings, reused or odd request ids, requests the HTTP parser rejects, and absolute-form
targets. Raw bytes go over a socket, because an HTTP client library would refuse to send them."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest

from proxy.record.clientstrings import MAX_CHARS, REPLACEMENT
from proxy.record.refusals import WHOLE_PER_MINUTE, requests_in
from proxy.runner import ProxyThread
from tests.helpers import http, read_records

CHAT = b'{"model": "fast", "stream": true, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
def upstream_url(fake_url: str) -> str:
    return fake_url


async def send_raw(url: str, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """Send `head` (request line and headers, no blank line) and `body` on a new connection that the
    server closes after its answer; return the status, the headers and the raw body."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    length = b"Content-Length: %d\r\n" % len(body) if body else b""
    writer.write(head + b"\r\n" + length + b"Connection: close\r\n\r\n" + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    await writer.wait_closed()
    top, _, rest = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, rest


def chat_head(*extra: bytes) -> bytes:
    lines = [b"POST /v1/chat/completions HTTP/1.1", b"Host: slotwise", b"Content-Type: application/json",
             *extra]
    return b"\r\n".join(lines)


async def test_header_values_that_are_not_utf8_leave_a_record_and_metrics_keep_answering(
        proxy: ProxyThread) -> None:
    odd = (b"X-Slotwise-Purpose: role\xffplay", b"X-Slotwise-Client: \xfe\xffbob")
    status, _, body = await send_raw(proxy.url, chat_head(*odd), CHAT)
    assert status == 200 and b"[DONE]" in body
    status, _, body = await send_raw(proxy.url, chat_head(*odd), b"{not json")
    assert status == 400 and b"not valid JSON" in body  # a 500 when the record could not be written
    metrics = await asyncio.to_thread(http, "GET", proxy.url + "/metrics")
    assert metrics.status_code == 200
    assert f'purpose="role{REPLACEMENT}play"' in metrics.content.decode()
    status_page = await asyncio.to_thread(http, "GET", proxy.url + "/slotwise/status")
    assert status_page.status_code == 200
    records = read_records(proxy, 2)
    assert [(r["outcome"], r["status"]) for r in records] == [("done", 200), ("bad_request", 400)]
    assert {(r["purpose"], r["client"]) for r in records} == {
        (f"role{REPLACEMENT}play", f"{REPLACEMENT}{REPLACEMENT}bob")}


async def test_a_million_character_user_leaves_a_short_record(proxy: ProxyThread) -> None:
    body = {"model": "fast", "max_tokens": 2, "user": "u" * 1_000_000,
            "messages": [{"role": "user", "content": "hi"}]}
    reply = await asyncio.to_thread(http, "POST", proxy.url + "/v1/chat/completions", body)
    assert reply.status_code == 200
    (record,) = read_records(proxy, 1)
    assert len(record["client"]) == MAX_CHARS and record["client"].endswith("…")
    assert Path(proxy.config.log.timing).stat().st_size < 3000


async def test_two_requests_with_one_id_are_both_shown_and_recorded_apart(proxy: ProxyThread) -> None:
    body = {"model": "slow", "stream": True, "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:
        first = await session.post(proxy.url + "/v1/chat/completions", json=body,
                                   headers={"X-Request-Id": "dup"})
        second = await session.post(proxy.url + "/v1/chat/completions", json=body,
                                    headers={"X-Request-Id": "dup"})
        await first.content.readany()
        await second.content.readany()
        async with session.get(proxy.url + "/slotwise/status") as status:
            flights = sorted(f["id"] for f in (await status.json())["flights"])
        ids = [first.headers["X-Request-Id"], second.headers["X-Request-Id"]]
        for response in (first, second):
            await response.read()
            response.release()
    assert ids[0] == "dup" and ids[1].startswith("dup~") and len(ids[1]) == len("dup~") + 6
    assert flights == ids
    records = read_records(proxy, 2)
    assert sorted(r["id"] for r in records) == ids
    assert all(r["outcome"] == "done" and r["events"] == 20 for r in records)


async def test_a_request_id_is_made_a_safe_token_and_the_response_says_the_id_used(
        proxy: ProxyThread) -> None:
    status, headers, _ = await send_raw(proxy.url, chat_head(b"X-Request-Id: my id\xff"), CHAT)
    assert status == 200 and headers["x-request-id"] == "my_id_"
    (record,) = read_records(proxy, 1)
    assert record["id"] == "my_id_"


async def test_requests_the_http_parser_rejects_are_one_warning_line_and_each_in_the_records(
        proxy: ProxyThread, caplog: pytest.LogCaptureFixture) -> None:
    bad = b"GET /health HTTP/1.1\r\nHost: slotwise\r\nX-Bad\x01Name: 1"
    with caplog.at_level(logging.DEBUG):
        answers = [await send_raw(proxy.url, bad) for _ in range(15)]
        whole = read_records(proxy, WHOLE_PER_MINUTE)
        proxy.stop()  # the summary of the others is written when their minute ends, or at the stop
    assert {status for status, _, _ in answers} == {400}
    records = read_records(proxy)
    assert records[:-1] == whole and len(whole) == WHOLE_PER_MINUTE
    assert len({r["id"] for r in records}) == len(records) and sum(map(requests_in, records)) == 15
    assert {(r["outcome"], r["status"], r["kind"]) for r in whole} == {("bad_request", 400, "other")}
    assert (records[-1]["kind"], records[-1]["refused_count"]) == ("refusals", 15 - WHOLE_PER_MINUTE)
    assert whole[0]["error"].startswith("not valid HTTP: ")
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]
    lines = [r for r in caplog.records if r.levelno == logging.WARNING and "not valid HTTP" in r.getMessage()]
    assert len(lines) == 10  # then quiet for the rest of the minute
    assert all("\n" not in r.getMessage() for r in lines)


async def test_an_absolute_form_target_is_a_clear_400_from_slotwise(
        proxy: ProxyThread, caplog: pytest.LogCaptureFixture) -> None:
    head = b"GET http://evil.example/v1/models HTTP/1.1\r\nHost: evil.example"
    with caplog.at_level(logging.WARNING):
        status, headers, body = await send_raw(proxy.url, head)
    assert status == 400 and headers["x-slotwise-error"] == "invalid_request_error"
    message = orjson.loads(body)["error"]["message"]
    assert "'http://evil.example/v1/models' is not a path" in message
    (record,) = read_records(proxy, 1)
    assert (record["outcome"], record["status"]) == ("bad_request", 400)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_body_that_does_not_decode_is_a_clear_400_with_one_warning_line(
        proxy: ProxyThread, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        status, _, body = await send_raw(proxy.url, chat_head(b"Content-Encoding: gzip"),
                                         b"\x1f\x8b\x08\x00 not gzip at all")
    assert status == 400
    expected = "the request body could not be read: Can not decode content-encoding: gzip"
    assert orjson.loads(body)["error"]["message"] == f"slotwise: {expected}"
    (record,) = read_records(proxy, 1)
    assert (record["outcome"], record["error"]) == ("bad_request", expected)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("method, path", [
    ("GET", "/health"), ("GET", "/get_load"), ("GET", "/metrics"), ("GET", "/slotwise/status"),
    ("GET", "/slotwise/"), ("GET", "/get_load?format=nope"), ("GET", "/slotwise/warm/no-such-id"),
    ("POST", "/render")])
async def test_slotwise_s_own_answers_say_the_client_s_request_id(
        proxy: ProxyThread, method: str, path: str) -> None:
    """As the answers it forwards do: a caller matches an answer to its request, or to its own logs,
    by the id it sent (the answers slotwise makes itself write no record, so the id is not made
    unique: it is the client's, made a safe token)."""
    async with aiohttp.ClientSession() as session:
        headers = {"X-Request-Id": "router-check 7"}
        async with session.request(method, proxy.url + path, headers=headers, data=b"{") as answer:
            assert answer.headers["X-Request-Id"] == "router-check_7", answer.status
        async with session.request(method, proxy.url + path, data=b"{") as answer:
            made = answer.headers["X-Request-Id"]  # none sent: one made up, as for a forwarded one
            assert len(made) == 16 and int(made, 16) >= 0


async def test_a_messages_request_is_recorded_for_its_metadata_user_id(proxy: ProxyThread) -> None:
    """Anthropic's SDK and Claude clients name the end user in `metadata.user_id` (its Messages API
    has no `user`); LiteLLM passes it on for /v1/messages."""
    body = {"model": "m", "max_tokens": 2, "metadata": {"user_id": "user_7f3a\u0007"},
            "messages": [{"role": "user", "content": "hi"}]}
    reply = await asyncio.to_thread(http, "POST", proxy.url + "/v1/messages", body)
    assert reply.status_code == 200
    (record,) = read_records(proxy, 1)
    assert record["kind"] == "messages" and record["client"] == f"user_7f3a{REPLACEMENT}"
