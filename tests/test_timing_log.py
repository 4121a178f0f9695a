"""The timing log: a record is in the file or counted as lost (never written later), the log is opened
anew on SIGHUP and on a reload that moves it, and a log that cannot be opened is a config error."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.ops.lifecycle import Operations, reload_config
from proxy.record.schema import Record
from proxy.record.timing_log import TimingLog
from proxy.runner import ProxyThread
from tests.conftest import StartProxy
from tests.helpers import http, read_records
from tests.served import GRACE_S, SLOTWISE, Served, serve, write_config


def ids_in(path: Path) -> list[str]:
    """The ids of the lines that are records; a cut line is skipped (the report counts it)."""
    found = []
    for line in path.read_bytes().splitlines():
        try:
            found.append(orjson.loads(line)["id"])
        except orjson.JSONDecodeError:
            continue
    return found


class FlakyDisk:
    """os.write, but the disk is full for the calls numbered in `full` (ENOSPC), and writes only
    `cut` bytes of the call numbered `torn` before failing."""

    def __init__(self, full: set[int], torn: int | None = None, cut: int = 10) -> None:
        self.full, self.torn, self.cut, self.calls = full, torn, cut, 0

    def __call__(self, fd: int, data: bytes | memoryview) -> int:
        self.calls += 1
        if self.calls in self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        if self.calls == self.torn:
            self.full.add(self.calls + 1)  # the rest of this line fails too
            return os.write(fd, bytes(data[:self.cut]))
        return os.write(fd, data)


def test_records_lost_to_a_full_disk_are_counted_and_never_written_later(tmp_path: Path) -> None:
    path = tmp_path / "timing.jsonl"
    log = TimingLog(path, write=FlakyDisk(full={2, 3}))
    results = [log.write(Record(id=name)) for name in "abcde"]
    log.close()
    assert results == [True, False, False, True, True]
    assert (log.written, log.lost) == (3, 2)
    assert ids_in(path) == ["a", "d", "e"]


def test_a_line_cut_off_by_a_full_disk_does_not_spoil_the_next_one(tmp_path: Path) -> None:
    path = tmp_path / "timing.jsonl"
    log = TimingLog(path, write=FlakyDisk(full=set(), torn=2))
    for name in "abc":
        log.write(Record(id=name))
    log.close()
    assert (log.written, log.lost) == (2, 1)
    assert ids_in(path) == ["a", "c"]
    assert len(path.read_bytes().splitlines()) == 3  # a, the cut part of b, c


FILE_SIZE_LIMIT = textwrap.dedent("""
    import os, resource, signal, sys
    from proxy.record.schema import Record
    from proxy.record.timing_log import TimingLog
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    path, extra = sys.argv[1], int(sys.argv[2])
    log = TimingLog(path)
    log.write(Record(id="a"))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + extra, hard))
    log.write(Record(id="b"))
    log.write(Record(id="c"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    log.write(Record(id="d"))
    log.close()
    print(log.written, log.lost)
""")


@pytest.mark.parametrize("extra", [0, 20], ids=["full", "full-mid-line"])
def test_a_real_file_that_cannot_grow_loses_the_records_it_refused(tmp_path: Path, extra: int) -> None:
    """The file-size limit makes the kernel refuse writes as a full disk does (EFBIG for ENOSPC);
    a buffered writer kept the refused lines and wrote them after the limit was lifted."""
    path = tmp_path / "timing.jsonl"
    done = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, str(path), str(extra)],
                          capture_output=True, text=True, timeout=60, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.stdout.split() == ["2", "2"]
    assert ids_in(path) == ["a", "d"]


# --- the proxy --------------------------------------------------------------------------------------

def chat(url: str) -> int:
    body = {"model": "fast", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    return http("POST", url + "/v1/chat/completions", body).status_code


async def test_a_full_disk_shows_in_the_status_page_and_metrics(fake_url: str,
                                                                 start_proxy: StartProxy) -> None:
    proxy = start_proxy(fake_url, log={"timing": "/dev/full"})
    assert await asyncio.to_thread(chat, proxy.url) == 200
    status = (await asyncio.to_thread(http, "GET", proxy.url + "/slotwise/status")).json()
    assert status["timing_log"] == {"path": "/dev/full", "written": 0, "lost": 1}
    metrics = (await asyncio.to_thread(http, "GET", proxy.url + "/metrics")).content.decode()
    assert "slotwise_timing_records_lost_total 1.0" in metrics


async def reload_from(proxy: ProxyThread, path: Path) -> Any:
    return await asyncio.to_thread(proxy.call, reload_config(proxy.state, Operations(), path))


async def test_a_reload_moves_the_timing_log_to_its_new_path(fake_url: str, start_proxy: StartProxy,
                                                             tmp_path: Path) -> None:
    proxy = start_proxy(fake_url, listen={"shutdown_grace_s": GRACE_S})
    old, new = Path(proxy.config.log.timing), tmp_path / "moved" / "timing.jsonl"
    await asyncio.to_thread(chat, proxy.url)
    result = await reload_from(proxy, write_config(tmp_path / "new.toml", fake_url, new))
    assert result.ok, result.message
    await asyncio.to_thread(chat, proxy.url)
    assert len(read_records(old)) == 1
    (rec,) = read_records(new, 1)
    assert rec["config_gen"] == 2


async def test_a_reload_to_a_timing_log_that_cannot_be_opened_is_refused(
        fake_url: str, start_proxy: StartProxy, tmp_path: Path) -> None:
    proxy = start_proxy(fake_url, listen={"shutdown_grace_s": GRACE_S})
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "timing.jsonl"
    result = await reload_from(proxy, write_config(tmp_path / "bad.toml", fake_url, bad))
    assert not result.ok and f"log.timing: cannot open '{bad}' for appending" in result.message
    assert proxy.state.config_gen == 1
    await asyncio.to_thread(chat, proxy.url)
    assert len(read_records(proxy, 1)) == 1


def test_serve_with_a_timing_log_that_cannot_be_opened_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "timing.jsonl"
    config = write_config(tmp_path / "c.toml", "http://127.0.0.1:9", bad)
    done = subprocess.run([str(SLOTWISE), "serve", "--config", str(config)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert f"slotwise: config error: log.timing: cannot open '{bad}' for appending: Not a directory" \
        in done.stderr
    assert "cannot listen" not in done.stderr and "Unclosed" not in done.stderr


async def hangup_and_wait(served: Served, generation: int) -> None:
    served.process.send_signal(signal.SIGHUP)
    await asyncio.to_thread(served.wait_for, f"generation {generation} in force for new requests")


async def test_sighup_after_a_move_and_create_rotation_writes_to_the_new_file(
        fake_url: str, tmp_path: Path, serving: list[Served]) -> None:
    timing = tmp_path / "timing.jsonl"
    served = await asyncio.to_thread(serve, write_config(tmp_path / "c.toml", fake_url, timing))
    serving.append(served)
    assert await asyncio.to_thread(chat, served.url) == 200
    read_records(timing, 1)
    timing.rename(tmp_path / "timing.jsonl.1")  # logrotate's default: move, then SIGHUP
    await hangup_and_wait(served, 2)
    assert await asyncio.to_thread(chat, served.url) == 200
    assert [r["config_gen"] for r in read_records(timing, 1)] == [2]
    assert [r["config_gen"] for r in read_records(tmp_path / "timing.jsonl.1")] == [1]
    timing.unlink()  # removed: SIGHUP makes the file again
    await hangup_and_wait(served, 3)
    assert await asyncio.to_thread(chat, served.url) == 200
    assert [r["config_gen"] for r in read_records(timing, 1)] == [3]
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 20) == 0


@pytest.mark.parametrize("damage, message", [
    (lambda text: text.replace(b"[listen]", b"# caf\xe9\n[listen]"), "is not UTF-8 text: byte 0x"),
    (lambda text: text.replace(b".jsonl", b"\\u0000.jsonl"), "log.timing: holds a NUL character"),
], ids=["not-utf8", "nul-in-a-path"])
async def test_a_reload_from_a_config_not_utf8_or_with_a_nul_is_refused_and_the_log_reopened(
        fake_url: str, start_proxy: StartProxy, tmp_path: Path, damage: Any, message: str) -> None:
    proxy = start_proxy(fake_url, listen={"shutdown_grace_s": GRACE_S})
    timing = Path(proxy.config.log.timing)
    config = write_config(tmp_path / "bad.toml", fake_url, timing)
    config.write_bytes(damage(config.read_bytes()))
    timing.rename(tmp_path / "timing.jsonl.1")  # a rotation's SIGHUP that meets a bad file
    result = await reload_from(proxy, config)
    assert not result.ok and message in result.message, result.message
    assert proxy.state.config_gen == 1
    assert await asyncio.to_thread(chat, proxy.url) == 200
    assert len(read_records(timing, 1)) == 1  # the log was opened anew all the same
