"""`slotwise serve` in its own process with a config generated from tables: what the benchmarks, the
demo and the testbed's cluster run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson

from proxy.testbed.toml import toml_text

_LISTENING = re.compile(r"slotwise listening on (http://\S+),")


class SlotwiseProcess:
    """`slotwise serve` in its own process (its own core), on a free port, with a TOML config
    written from `tables`."""

    def __init__(self, upstream_url: str, work_dir: Path, *, env: dict[str, str] | None = None,
                 **tables: dict[str, Any]) -> None:
        self.work_dir = work_dir
        self.env = env or {}
        """Extra environment of the process (PYTHONPATH to run another version of slotwise)."""
        work_dir.mkdir(parents=True, exist_ok=True)
        self.timing_path = work_dir / "timing.jsonl"
        self.config_path = work_dir / "slotwise.toml"
        self.stderr_path = work_dir / "slotwise.log"
        body: dict[str, dict[str, Any]] = {"upstream": {"url": upstream_url}, "listen": {"port": 0},
                "log": {"timing": str(self.timing_path), "level": "info"}, **tables}
        self.config_path.write_text(toml_text(body))
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None, "slotwise is not running"
        return self._process.pid

    def start(self, timeout: float = 30.0) -> SlotwiseProcess:
        stderr = open(self.stderr_path, "wb")  # noqa: SIM115 (handed to the child)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(self.config_path)],
            stdout=subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env}, cwd=self.work_dir)
        stderr.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.stderr_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                return self
            if self._process.poll() is not None:
                break
            time.sleep(0.05)
        log = self.stderr_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"slotwise did not start; its log ends with:\n{log}")

    def stop(self) -> int | None:
        process, self._process = self._process, None
        if process is None:
            return None
        process.terminate()
        try:
            return process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def records(self) -> list[dict[str, Any]]:
        if not self.timing_path.exists():
            return []
        return [orjson.loads(line) for line in self.timing_path.read_bytes().splitlines()]

    def cpu_seconds(self) -> float:
        """User + system CPU time the process has used so far (Linux /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks

    def __enter__(self) -> SlotwiseProcess:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
