"""A real `slotwise serve` process for the operations tests: its config file, its log lines, and a
fixture that kills what a test left running (registered for every test module in conftest.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proxy.testbed.toml import toml_text

SLOTWISE = Path(sys.executable).parent / "slotwise"
GRACE_S = 5  # listen.shutdown_grace_s of every proxy here: a reload may not change it


def write_config(path: Path, upstream: str, timing: Path, **tables: dict[str, Any]) -> Path:
    """A TOML config file: [upstream] url, [listen] port 0 and grace, [log] timing, + `tables`."""
    sections: dict[str, dict[str, Any]] = {
        "upstream": {"url": upstream}, "listen": {"port": 0, "shutdown_grace_s": GRACE_S},
        "log": {"timing": str(timing)}}
    for name, values in tables.items():
        sections[name] = {**sections.get(name, {}), **values}
    path.write_text(toml_text(sections))
    return path


@dataclass
class Served:
    """A `slotwise serve` subprocess and the lines of its log (stderr) so far."""

    process: subprocess.Popen[bytes]
    lines: list[str] = field(default_factory=list)
    url: str = ""

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no log line matching {pattern!r}; log:\n" + "".join(self.lines))

    def close(self) -> None:
        self.process.wait(10)
        self._reader.join(5)
        if self.process.stderr is not None:
            self.process.stderr.close()

    def start_reading(self) -> None:
        assert self.process.stderr is not None
        stream = self.process.stderr

        def read() -> None:
            for raw in stream:
                self.lines.append(raw.decode(errors="replace"))

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()


def serve(config: Path) -> Served:
    """Start `slotwise serve --config FILE`; return once it says where it listens."""
    process = subprocess.Popen([str(SLOTWISE), "serve", "--config", str(config)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    served = Served(process)
    served.start_reading()
    served.url = served.wait_for(r"slotwise listening on (http://\S+?),").group(1)
    return served


@pytest.fixture
def serving() -> Iterator[list[Served]]:
    """Started processes, killed at teardown if a test left one running."""
    started: list[Served] = []
    yield started
    for served in started:
        if served.process.poll() is None:
            served.process.kill()
        served.close()
