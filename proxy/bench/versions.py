"""`slotwise bench overhead --against REV`: this checkout's slotwise and the one at a git revision,
side by side in one run in front of one llama-server: time to first token through each
(alternating, so drift cancels out) and how many stream events each relays per CPU-second.

The other version runs from a git worktree of REV in a temporary folder (its own `proxy` package on
PYTHONPATH), so a change can be checked for overhead against the commit before it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.bench.harness import temp_dir
from proxy.bench.overhead import measure_rate, measure_ttft
from proxy.testbed.model import write_model
from proxy.testbed.server import LlamaServer
from proxy.testbed.slotwise import SlotwiseProcess


class VersionError(Exception):
    """REV cannot be checked out (not a git checkout, unknown revision)."""


@dataclass
class Side:
    ttft_ms: float
    events_per_cpu_s: float


@dataclass
class Versions:
    rev: str
    ttft_added_ms: float
    """Median of the paired differences, this checkout minus REV (negative: this one is quicker)."""
    here: Side
    there: Side

    def as_dict(self) -> dict[str, Any]:
        return {"rev": self.rev, "ttft_added_ms": self.ttft_added_ms,
                "here": self.here.__dict__, "there": self.there.__dict__}


def checkout(rev: str, into: Path) -> Path:
    """A worktree of `rev` of the repository this package lives in."""
    repo = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (repo / ".git").exists():
        raise VersionError(f"{repo} is not a git checkout: --against needs one")
    done = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(into), rev],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise VersionError(f"cannot check out {rev!r}: {done.stderr.strip()}")
    return into


def remove(worktree: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(worktree)],
                   capture_output=True)


def run_against(rev: str, *, pairs: int = 40, streams: int = 8, tokens: int = 1500) -> Versions:
    work = temp_dir("slotwise-bench-versions-")
    old = checkout(rev, work / "other")
    try:
        model = write_model(work / "model", "tiny", seed=0)
        with LlamaServer(model.model, args=["-np", str(streams), "-c", str(streams * 2048)],
                         log_path=work / "llama-server.log") as server, \
                SlotwiseProcess(server.url, work / "here") as here, \
                SlotwiseProcess(server.url, work / "there",
                                env={"PYTHONPATH": python_path(str(old))}) as there:
            here_ms, there_ms = asyncio.run(measure_ttft(here.url, there.url, pairs))
            capacity = [_capacity(p, streams, tokens) for p in (here, there, here, there)]
    finally:
        remove(old)
    added = [h - t for h, t in zip(here_ms, there_ms, strict=True)]
    return Versions(rev=rev, ttft_added_ms=statistics.median(added),
                    here=Side(statistics.median(here_ms), max(capacity[0], capacity[2])),
                    there=Side(statistics.median(there_ms), max(capacity[1], capacity[3])))


def _capacity(proxy: SlotwiseProcess, streams: int, tokens: int) -> float:
    """Stream events relayed per CPU-second of the proxy's process."""
    before = proxy.cpu_seconds()
    _, events = asyncio.run(measure_rate(proxy.url, streams, tokens))
    cpu = proxy.cpu_seconds() - before
    return events / cpu if cpu else 0.0


def python_path(extra: str) -> str:
    """`extra` first on PYTHONPATH, before what the caller's environment has."""
    return os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH", "")) if p)
