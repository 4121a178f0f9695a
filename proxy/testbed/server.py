"""Runs a real llama-server on a free 127.0.0.1 port for tests, benchmarks and demos: starts it
with the testbed model, waits for /health, writes its log (prefix and timestamps on) to a file that
others parse, and always stops the process. Start and stop block and need no event loop; from async
code call them through `asyncio.to_thread`."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from proxy.testbed.binary import find_llama_server

COMMAND_LINE = "# slotwise: "
"""How the log of a llama-server this module starts opens: this, then the command line (the what-if
reads the flags llama-server's own log does not show from it)."""

DEFAULT_THREADS = 2  # the test machines have 2 cores, shared; more threads only add contention
STOP_GRACE_SECONDS = 10.0
PORT_ATTEMPTS = 3


class ServerStartError(RuntimeError):
    """llama-server exited or never became healthy; the message carries the log tail."""


class LlamaServer:
    """One llama-server process. `with LlamaServer(model) as server:` then use `server.url`."""

    def __init__(
        self,
        model: Path,
        *,
        lora: Path | None = None,
        args: Sequence[str] = (),
        binary: Path | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 60.0,
        port: int = 0,
    ) -> None:
        self.model = Path(model)
        self.lora = lora
        self.args = tuple(args)
        self.binary = binary
        self.log_path = log_path if log_path is not None else _temp_log_path()
        self.startup_timeout = startup_timeout
        self.port = port
        self._fixed_port = port
        """Listen on this port at every start (a restart keeps the URL); 0 = a free one each time."""
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self._process is None:
            raise RuntimeError("llama-server is not running; call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> LlamaServer:
        """Start the process and return once GET /health answers 200; stops it on any failure."""
        if self._process is not None:
            raise RuntimeError("llama-server is already running")
        binary = self.binary or find_llama_server()
        attempts_left = PORT_ATTEMPTS
        while True:
            try:
                return self._start_once(binary)
            except ServerStartError:
                attempts_left -= 1
                # Another process may take the port between our probe and the server's bind.
                if attempts_left == 0 or not self._lost_port_race():
                    raise

    def stop(self) -> None:
        """Terminate the process, wait, kill it if it lingers. Safe to call more than once."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process exits on its own (a foreground server); returns its exit code."""
        if self._process is None:
            raise RuntimeError("llama-server is not running")
        return self._process.wait(timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text.splitlines()[-lines:])

    def command(self, binary: Path) -> list[str]:
        argv = [str(binary), "--host", "127.0.0.1", "--port", str(self.port), "-m", str(self.model)]
        if self.lora is not None:
            argv += ["--lora", str(self.lora)]
        if not {"-t", "--threads"} & set(self.args):
            argv += ["-t", str(DEFAULT_THREADS)]
        return argv + list(self.args)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _start_once(self, binary: Path) -> LlamaServer:
        try:
            self._launch(binary)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self, binary: Path) -> None:
        self.port = self._fixed_port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"{COMMAND_LINE}{' '.join(self.command(binary))}\n".encode())
            log.flush()
            self._process = subprocess.Popen(
                self.command(binary),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_server_env(),
            )

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise ServerStartError(self._failure(f"llama-server exited with code {code}"))
            if health_status(self.port) == 200:
                return
            time.sleep(0.1)
        raise ServerStartError(
            self._failure(f"llama-server was not healthy after {self.startup_timeout:.0f} s")
        )

    def _failure(self, reason: str) -> str:
        return f"{reason}; log {self.log_path}, last lines:\n{self.log_tail()}"

    def _lost_port_race(self) -> bool:
        tail = self.log_tail(10).lower()
        return "bind" in tail or "address already in use" in tail


def free_port() -> int:
    """A port the OS says is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def health_status(port: int, timeout: float = 2.0) -> int | None:
    """The status of GET /health, or None while nothing answers."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def _server_env() -> dict[str, str]:
    # LLAMA_ARG_* variables in the user's shell would silently change the testbed (context size,
    # log prefix that the log parsers rely on, an API key); the command line is the only input.
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("LLAMA_ARG_") and key != "LLAMA_API_KEY"
    }


def _temp_log_path() -> Path:
    handle, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
    os.close(handle)
    return Path(name)
