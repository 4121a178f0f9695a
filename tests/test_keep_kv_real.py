"""keep_kv in front of a real llama-server (tiny model, `-np 2`, `--slot-save-path`): a conversation
saved, llama-server restarted, and the next turn restored (cached, and far faster than cold); nothing
saved while a request is in flight; the disk budget deletes the least recently used; a damaged file
(cut short, or other bytes) is never handed to llama-server, which aborts on one; a file the server
died on is quarantined, never tried again; and a server without `--slot-save-path` is detected."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from proxy.keep.index import INDEX_NAME, load_index, quarantined, seal, write_index
from proxy.keep.keeper import KEEPER
from proxy.runner import ProxyThread
from proxy.testbed.model import ModelFiles
from proxy.testbed.server import LlamaServer
from proxy.testbed.words import filler
from tests.conftest import StartLlamaServer, StartProxy
from tests.helpers import http as call
from tests.helpers import read_records
from tests.test_prefill_real import Stream

pytestmark = pytest.mark.real_server

PREFILL = {"mode": "chunk", "cold_tokens": 100_000}
"""The estimate keep_kv needs, and no pieces (these tests are about whole prompts)."""


def keep(directory: Path, **knobs: Any) -> dict[str, Any]:
    return {"enabled": True, "dir": str(directory), "save_after_idle_s": 1.0, "min_tokens": 256,
            **knobs}


def history(seed: int, turns: int) -> list[dict[str, str]]:
    """A conversation of about 270 tokens a turn pair, ending with the assistant's reply."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": f"conversation {seed}"}]
    for i in range(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": filler(rng, 55)})
    return messages


def turn(messages: list[dict[str, str]], text: str) -> dict[str, Any]:
    return {"messages": [*messages, {"role": "user", "content": text}], "max_tokens": 3,
            "stream": True}


def ask(proxy: ProxyThread, body: dict[str, Any]) -> dict[str, Any]:
    """One turn through the proxy; its record."""
    before = len(read_records(proxy))
    reply = call("POST", proxy.url + "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.content[:300]
    def chats() -> list[dict[str, Any]]:  # a restore's own record may come first
        return [r for r in read_records(proxy)[before:] if r["kind"] == "chat"]

    wait_for(lambda: bool(chats()))
    return chats()[-1]


def status(proxy: ProxyThread) -> dict[str, Any]:
    section: dict[str, Any] = call("GET", proxy.url + "/slotwise/status").json()["keep_kv"]
    return section


def wait_for(what: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def saved(proxy: ProxyThread, count: int = 1) -> list[dict[str, Any]]:
    wait_for(lambda: status(proxy)["saves"]["done"] >= count)
    files: list[dict[str, Any]] = status(proxy)["files"]
    return files


@pytest.fixture
def save_dir(tmp_path: Path) -> Path:
    path = tmp_path / "kv"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def restart(llama_server_binary: Path, tiny_model: ModelFiles, tmp_path: Path
            ) -> Iterator[Callable[[LlamaServer], LlamaServer]]:
    """Stop a server and start the same one again on its port (its saves stay on disk)."""
    started: list[LlamaServer] = []

    def again(server: LlamaServer) -> LlamaServer:
        port = server.port
        server.stop()
        fresh = LlamaServer(server.model, lora=server.lora, args=server.args, port=port,
                            binary=llama_server_binary, log_path=tmp_path / f"restart-{len(started)}.log")
        started.append(fresh)
        return fresh.start()

    try:
        yield again
    finally:
        for server in started:
            server.stop()


def returning(proxy: ProxyThread, server: LlamaServer,
              restart: Callable[[LlamaServer], LlamaServer], *, seed: int
              ) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """A conversation's first turn through `proxy`, saved, then llama-server restarted: the
    history as its next turn carries it, and the first turn's record."""
    wait_for(lambda: status(proxy)["working"] is True)
    talk = history(seed, 13)
    cold = ask(proxy, turn(talk, "first"))
    saved(proxy)
    restart(server)
    talk += [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    return talk, cold


def server_args(save_dir: Path) -> list[str]:
    return ["-np", "2", "-c", "16384", "--slot-save-path", str(save_dir)]


def test_a_saved_conversation_is_restored_after_a_restart(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path,
        restart: Callable[[LlamaServer], LlamaServer]) -> None:
    server = start_llama_server(lora=False, args=server_args(save_dir))
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir))
    wait_for(lambda: status(proxy)["working"] is True)
    assert status(proxy)["problem"] is None  # a private directory, files slotwise owns
    talk = history(1, 13)
    cold = ask(proxy, turn(talk, "first"))
    [file] = saved(proxy)
    path = save_dir / file["name"]
    assert path.stat().st_mode & 0o777 == 0o600 and file["tokens"] >= cold["prompt_tokens"]
    index = (save_dir / INDEX_NAME).read_text()
    assert " ".join(talk[1]["content"].split()[:3]) not in index  # hashes and counts, never text

    restart(server)
    talk += [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    warm = ask(proxy, turn(talk, "second"))
    assert warm["restored_tokens"] >= cold["prompt_tokens"] - 64
    # to the token, from the file's own ids: the estimate after the restore is what was computed
    assert warm["timings"]["cache_n"] == warm["restored_tokens"]
    assert warm["est_new_tokens"] == warm["timings"]["prompt_n"] < 100  # only the new messages
    assert warm["ttft_ms"] < cold["ttft_ms"] / 3, (warm["ttft_ms"], cold["ttft_ms"])
    restores = [r for r in read_records(proxy) if r["kind"] == "kv_restore"]
    assert [r["outcome"] for r in restores] == ["done"] and restores[0]["kv_bytes"] > 0


def test_a_restore_for_explicit_lora_settings_is_kept(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path,
        restart: Callable[[LlamaServer], LlamaServer]) -> None:
    """llama-server clears a slot's cache for a request whose explicit `lora` differs from the
    slot's last one, and a slot that never had a task counts as different: with `lora.mode` fixed
    a restore must not go into one (it did: bench day, a 6,016-token restore recomputed whole)."""
    server = start_llama_server(lora=True, args=server_args(save_dir))
    fixed = {"mode": "fixed", "adapters": [{"id": 0, "scale": 1.0}]}
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir), lora=fixed)
    talk, cold = returning(proxy, server, restart, seed=5)
    warm = ask(proxy, turn(talk, "second"))
    assert warm["restored_tokens"] >= cold["prompt_tokens"] - 64
    assert warm["timings"]["prompt_n"] < 100, warm["timings"]  # kept, not recomputed


def test_a_warm_up_of_a_returning_conversation_restores_its_file(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path,
        restart: Callable[[LlamaServer], LlamaServer]) -> None:
    """The chat app warms a conversation when its user opens it (docs/warm.md): after a restart
    its kept file is restored then, not computed, and the turn that follows finds it in a slot."""
    server = start_llama_server(lora=False, args=server_args(save_dir))
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir), warm={"enabled": True})
    talk, cold = returning(proxy, server, restart, seed=3)
    asked = call("POST", proxy.url + "/slotwise/warm/v1/chat/completions", {"messages": talk})
    assert asked.status_code == 202, asked.content[:300]
    warm_id = asked.json()["id"]
    wait_for(lambda: any(r["id"] == warm_id for r in read_records(proxy)))
    [warmed] = [r for r in read_records(proxy) if r["id"] == warm_id]
    assert warmed["outcome"] == "done", warmed["policy_note"]
    assert warmed["restored_tokens"] >= cold["prompt_tokens"] - 64
    assert warmed["fed_tokens"] < 100  # the file's tokens were restored, not computed
    assert [r["outcome"] for r in read_records(proxy) if r["kind"] == "kv_restore"] == ["done"]
    after = ask(proxy, turn(talk, "second"))
    assert after["restored_tokens"] == 0  # in a slot already
    assert after["timings"]["prompt_n"] < 100 and after["timings"]["cache_n"] >= cold["prompt_tokens"] - 64


def test_a_warm_up_prefix_is_seen_in_its_slot_so_no_restore_takes_it_from_its_turn(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path) -> None:
    """The keep store finds a warm-up's prefix where llama-server shows it (an idle slot
    holding exactly its tokens) and lets it go when its turn takes that slot: what rule 7 needs to
    keep a restore out of the slot a waiting turn's warm-up filled (tests/test_keep_store.py)."""
    server = start_llama_server(lora=False, args=server_args(save_dir))
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir), warm={"enabled": True})
    wait_for(lambda: status(proxy)["working"] is True)
    store = proxy.app[KEEPER].store
    talk = history(5, 13)
    asked = call("POST", proxy.url + "/slotwise/warm/v1/chat/completions", {"messages": talk})
    assert asked.status_code == 202, asked.content[:300]
    warm_id = asked.json()["id"]
    wait_for(lambda: any(r["id"] == warm_id for r in read_records(proxy)))
    [warmed] = [r for r in read_records(proxy) if r["id"] == warm_id]
    assert warmed["outcome"] == "done" and warmed["fed_tokens"] > 256, warmed
    wait_for(lambda: bool(store.warm_in))
    [(slot_id, prefix)] = list(store.warm_in.items())
    shown = call("GET", server.url + "/slots").json()
    assert [s["n_prompt_tokens"] for s in shown if s["id"] == slot_id] == [prefix.tokens]
    after = ask(proxy, turn(talk, "next"))
    assert after["timings"]["cache_n"] >= prefix.tokens - 64  # its turn found it there
    wait_for(lambda: not store.warm_in)


def test_each_returning_conversation_in_turn_takes_the_one_slot_and_saves_the_other_first(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path,
        restart: Callable[[LlamaServer], LlamaServer]) -> None:
    """One slot, two conversations coming back in turn: each restore saves the conversation in
    the slot first, and the next restore may use that slot again (it could not: a restore that
    saved first left its slot claimed for good, and the next returning user waited
    `max_wait_s` for a slot, then was computed; bench day, 60 s)."""
    server = start_llama_server(lora=False, args=["-np", "1", "-c", "8192",
                                                  "--slot-save-path", str(save_dir)])
    proxy = start_proxy(server.url, prefill=PREFILL,
                        keep_kv=keep(save_dir, save_after_idle_s=5.0, max_wait_s=5.0))
    a, _ = returning(proxy, server, restart, seed=21)  # a is on disk only
    b = history(22, 13)
    ask(proxy, turn(b, "first"))
    time.sleep(1.0)  # slotwise finds b in the slot, not saved yet
    b += [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    for talk in (a, b):
        back = ask(proxy, turn(talk, "second"))
        assert back["restored_tokens"] > 1000, back["policy_note"]
        assert back["timings"]["prompt_n"] < 100, back["timings"]
    restores = [r for r in read_records(proxy) if r["kind"] == "kv_restore"]
    assert [r["outcome"] for r in restores] == ["done", "done"]
    assert restores[0]["policy_note"] is None  # b was saved first: nothing displaced


def test_nothing_is_saved_while_a_request_is_in_flight(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path) -> None:
    server = start_llama_server(lora=False, args=server_args(save_dir))
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir))
    wait_for(lambda: status(proxy)["working"] is True)
    ask(proxy, turn(history(2, 5), "first"))
    stream = Stream(proxy.url, tokens=20000)
    try:
        time.sleep(3.0)  # the conversation is due, its slot idle, but a stream generates
        assert status(proxy)["saves"]["done"] == 0
        assert [r for r in read_records(proxy) if r["kind"] == "kv_save"] == []
    finally:
        stream.close()
    saved(proxy)
    records = read_records(proxy)
    [save] = [r for r in records if r["kind"] == "kv_save"]
    busy = [r for r in records if r["kind"] == "chat"]
    assert all(_end(r) <= save["start"] for r in busy), "a save ran while a request was in flight"


def _end(record: dict[str, Any]) -> str:
    from datetime import datetime, timedelta
    end = datetime.fromisoformat(record["start"]) + timedelta(milliseconds=record["total_ms"])
    return end.isoformat(timespec="milliseconds")


def test_the_disk_budget_deletes_the_least_recently_used(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path,
        restart: Callable[[LlamaServer], LlamaServer]) -> None:
    server = start_llama_server(lora=False, args=server_args(save_dir))
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir, max_files=2))
    wait_for(lambda: status(proxy)["working"] is True)
    talks = {name: history(seed, 5) for seed, name in enumerate("abcd", start=10)}
    names: dict[str, str] = {}
    for i, name in enumerate("abc", start=1):
        if i == 1:  # a client's own id that looks like slotwise's: records' ids stay unique
            reply = call("POST", proxy.url + "/v1/chat/completions", turn(talks[name], "hi"),
                         headers={"X-Request-Id": "kv-save-1"})
            assert reply.status_code == 200
        else:
            ask(proxy, turn(talks[name], "hi"))
        names[name] = saved(proxy, i)[0]["name"]  # the most recently used first
    ids = [r["id"] for r in read_records(proxy)]
    assert "kv-save-1" in ids and len(ids) == len(set(ids))
    assert sorted(f["name"] for f in status(proxy)["files"]) == sorted([names["b"], names["c"]])
    assert not (save_dir / names["a"]).exists()

    restart(server)  # b's turn is then restored: b is used more recently than c
    assert ask(proxy, turn(talks["b"], "hi"))["restored_tokens"] > 0
    ask(proxy, turn(talks["d"], "hi"))
    wait_for(lambda: status(proxy)["saves"]["done"] >= 4)
    kept = {f["name"] for f in status(proxy)["files"]}
    assert names["b"] in kept and names["c"] not in kept and len(kept) == 2
    assert sorted(p.name for p in save_dir.iterdir() if p.name.endswith(".kv")) == sorted(kept)


def damage(path: Path, how: str) -> None:
    """Cut a file short (as a power loss can) or change bytes in its middle, keeping its size."""
    data = path.read_bytes()
    if how == "cut short":
        path.write_bytes(data[:len(data) // 2])
    else:
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 4096])
                         + data[mid + 4096:])


@pytest.mark.parametrize("how", ["cut short", "same size, other bytes"])
def test_a_damaged_file_is_never_restored_and_the_server_stays_up(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path,
        restart: Callable[[LlamaServer], LlamaServer], how: str) -> None:
    server = start_llama_server(lora=False, args=server_args(save_dir))
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir))
    wait_for(lambda: status(proxy)["working"] is True)
    talk = history(3, 5)
    first = ask(proxy, turn(talk, "first"))
    [file] = saved(proxy)
    damage(save_dir / file["name"], how)
    server = restart(server)
    again = ask(proxy, turn(talk, "first"))
    assert again["restored_tokens"] == 0 and again["timings"]["cache_n"] == 0
    assert again["timings"]["prompt_n"] == first["timings"]["prompt_n"]
    assert again["policy_note"].startswith(f"keep_kv: {file['name']} is damaged (")
    assert [r for r in read_records(proxy) if r["kind"] == "kv_restore"] == []  # never asked
    assert not (save_dir / file["name"]).exists() and status(proxy)["files"] == []
    assert call("GET", server.url + "/health").status_code == 200


def test_a_file_the_server_dies_on_is_quarantined_and_never_tried_again(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path,
        restart: Callable[[LlamaServer], LlamaServer]) -> None:
    """A file damaged before slotwise hashed it (the index vouches for it) crashes llama-server:
    the file is set aside at once, so the server's restart does not meet it again."""
    server = start_llama_server(lora=False, args=server_args(save_dir))
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir))
    wait_for(lambda: status(proxy)["working"] is True)
    talk = history(5, 5)
    ask(proxy, turn(talk, "first"))
    [file] = saved(proxy)
    proxy.stop()
    path = save_dir / file["name"]
    damage(path, "cut short")
    size, digest, _ = seal(path)
    write_index(save_dir, [replace(f, size=size, digest=digest) for f in load_index(save_dir)])
    server = restart(server)
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir))
    wait_for(lambda: status(proxy)["working"] is True)
    crashed = call("POST", proxy.url + "/v1/chat/completions", turn(talk, "first"))
    assert crashed.status_code >= 500  # llama-server died under the restore: nobody answered
    [restore] = [r for r in read_records(proxy) if r["kind"] == "kv_restore"]
    assert restore["outcome"] == "failed" and restore["status"] is None
    assert quarantined(save_dir) == [file["name"] + ".quarantined"] and not path.exists()
    server = restart(server)  # as systemd would
    again = ask(proxy, turn(talk, "first"))
    assert again["restored_tokens"] == 0 and again["timings"]["cache_n"] == 0
    assert len([r for r in read_records(proxy) if r["kind"] == "kv_restore"]) == 1
    assert status(proxy)["files"] == []


TWO_CLIENTS = {"clients": [{"name": "alice", "key": "alice-key"}, {"name": "bob", "key": "bob-key"}],
               "pages": "open"}


def as_client(proxy: ProxyThread, key: str, body: dict[str, Any]) -> dict[str, Any]:
    """One turn through the proxy with a client's key; its record."""
    before = len(read_records(proxy))
    reply = call("POST", proxy.url + "/v1/chat/completions", body,
                 headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.content[:300]
    wait_for(lambda: any(r["kind"] == "chat" for r in read_records(proxy)[before:]))
    return [r for r in read_records(proxy)[before:] if r["kind"] == "chat"][-1]


def test_with_client_keys_nobody_is_restored_or_told_another_clients_conversation(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path,
        restart: Callable[[LlamaServer], LlamaServer]) -> None:
    server = start_llama_server(lora=False, args=server_args(save_dir))
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir), access=TWO_CLIENTS,
                        warm={"enabled": True})
    wait_for(lambda: status(proxy)["working"] is True)
    talk = history(6, 9)
    as_client(proxy, "alice-key", turn(talk, "first"))
    saved(proxy)
    restart(server)
    bob = as_client(proxy, "bob-key", turn(talk, "first"))  # alice's words, sent by bob
    assert bob["client"] == "bob" and bob["restored_tokens"] == 0
    assert [r for r in read_records(proxy) if r["kind"] == "kv_restore"] == []
    restart(server)
    alice = as_client(proxy, "alice-key", turn(talk, "first"))  # her own file is hers
    assert alice["restored_tokens"] > 0
    warm = call("POST", proxy.url + "/slotwise/warm/v1/chat/completions", turn(talk, "next"),
                headers={"Authorization": "Bearer bob-key"})
    assert warm.status_code == 202
    assert not {"cached", "est_tokens", "computed_tokens", "reason"} & set(warm.json())


def test_a_server_without_slot_save_path_is_detected(
        start_llama_server: StartLlamaServer, start_proxy: StartProxy, save_dir: Path) -> None:
    server = start_llama_server(lora=False, args=["-np", "2", "-c", "8192"])
    proxy = start_proxy(server.url, prefill=PREFILL, keep_kv=keep(save_dir))
    wait_for(lambda: status(proxy)["working"] is not None)
    section = status(proxy)
    assert section["working"] is False and "--slot-save-path" in section["note"]
    metrics = call("GET", proxy.url + "/metrics").content.decode()
    assert "slotwise_keep_kv_working 0.0" in metrics
    ask(proxy, turn(history(4, 5), "first"))  # requests go as usual
    time.sleep(2.0)  # past keep_kv.save_after_idle_s
    assert status(proxy)["saves"]["done"] == 0 and list(save_dir.iterdir()) == []
