"""A cluster on loopback, for `slotwise testbed cluster`, the cluster tests and `slotwise bench
cluster`: N testbed llama-servers, one `slotwise serve` in front of each (node names node1..N), and
vllm-router (the `slotwise[cluster]` extra) in front of them all, with the health-check and
circuit-breaker settings of docs/scale-out.md. Start and stop block; whatever started is stopped.
"""

from __future__ import annotations

import http.client
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from proxy.testbed.model import ModelFiles, write_model
from proxy.testbed.server import LlamaServer, free_port
from proxy.testbed.slotwise import SlotwiseProcess

POLICIES = ("cache_aware", "power_of_two", "consistent_hash", "sticky_least_loaded", "round_robin",
            "random")
HEALTH_CHECK_S = 1
"""The router asks every node's /health this often (seconds); two failures in a row mark it dead."""
ROUTER_ARGS = (
    "--health-check-interval-secs", str(HEALTH_CHECK_S), "--health-check-timeout-secs", "1",
    "--health-failure-threshold", "2", "--health-success-threshold", "1",
    "--cb-failure-threshold", "3", "--cb-success-threshold", "1", "--cb-timeout-duration-secs", "5",
    "--worker-startup-check-interval", "1",
)
"""vllm-router's defaults notice a dead node after minutes; these, in seconds (docs/scale-out.md).
`--worker-startup-check-interval` is also how often power_of_two reads every node's /get_load."""


class RouterMissing(RuntimeError):
    """vllm-router is not installed; the message says how to install it."""


def find_router() -> Path:
    """The vllm-router command of this environment (the `slotwise[cluster]` extra)."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = beside if beside.exists() else shutil.which("vllm-router")
    if not found:
        raise RouterMissing("vllm-router is not installed: pip install 'slotwise[cluster]' "
                            "(or `make test`, which installs it)")
    return Path(found)


def http_status(url: str, path: str, timeout: float = 2.0) -> int | None:
    """The status of GET url+path, or None while nothing answers."""
    host, _, port = url.removeprefix("http://").partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


class RouterProcess:
    """vllm-router on a free 127.0.0.1 port, in front of `workers`, logging to `log_path`."""

    def __init__(self, workers: Sequence[str], policy: str, log_path: Path,
                 args: Sequence[str] = ROUTER_ARGS) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r} (valid: {', '.join(POLICIES)})")
        self.workers, self.policy, self.log_path, self.args = list(workers), policy, log_path, args
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # The metrics listener is on by default at a fixed port: give each router its own.
        return [str(find_router()), "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--policy", self.policy, "--worker-urls", *self.workers, *self.args]

    def start(self, timeout: float = 60.0) -> RouterProcess:
        self.port = free_port()
        command = self.command()
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            if http_status(self.url, "/readiness") == 200:
                return self
            time.sleep(0.1)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"vllm-router did not become ready; its log ends with:\n{tail}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # by pid: the router renames its process ("vllm::router")
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Node:
    name: str
    server: LlamaServer
    slotwise: SlotwiseProcess

    @property
    def url(self) -> str:
        return self.slotwise.url


@dataclass
class Cluster:
    """`with Cluster(2, work_dir) as cluster:` then `cluster.router.url`, `cluster.nodes[i]`."""

    size: int
    work_dir: Path
    policy: str = "cache_aware"
    server_args: Sequence[str] = ("-np", "4", "-c", "8192")
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Config tables every slotwise gets (e.g. {"prefill": {"mode": "defer"}})."""
    node_tables: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    """Config tables for one node (index from 0), on top of `tables`."""
    model: ModelFiles | None = None
    nodes: list[Node] = field(default_factory=list)
    routers: list[RouterProcess] = field(default_factory=list)

    @property
    def router(self) -> RouterProcess:
        return self.routers[0]

    def start(self) -> Cluster:
        if self.size < 1:
            raise ValueError(f"a cluster needs at least one node, got {self.size}")
        find_router()  # before minutes of work: say at once that it is missing
        try:
            files = self.model or write_model(self.work_dir / "model", "tiny", seed=0)
            for i in range(self.size):
                self.nodes.append(self._start_node(i, files))
            self.add_router(self.policy)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, i: int, files: ModelFiles) -> Node:
        name, where = f"node{i + 1}", self.work_dir / f"node{i + 1}"
        where.mkdir(parents=True, exist_ok=True)
        server = LlamaServer(files.model, lora=files.lora, args=self.server_args,
                             log_path=where / "llama-server.log", port=free_port())
        server.start()
        tables = {**self.tables, **self.node_tables.get(i, {})}
        cluster_table = {"node": name, **tables.pop("cluster", {})}
        slotwise = SlotwiseProcess(server.url, where, cluster=cluster_table, **tables)
        node = Node(name, server, slotwise)
        try:
            slotwise.start()
        except BaseException:
            server.stop()
            raise
        return node

    def add_router(self, policy: str) -> RouterProcess:
        """Another router in front of the same nodes (a benchmark compares two side by side)."""
        router = RouterProcess([n.url for n in self.nodes], policy,
                               self.work_dir / f"router-{len(self.routers) + 1}-{policy}.log")
        self.routers.append(router)
        return router.start()

    def node_named(self, name: str) -> Node:
        (node,) = [n for n in self.nodes if n.name == name]
        return node

    def stop(self) -> None:
        for router in self.routers:
            router.stop()
        for node in self.nodes:
            node.slotwise.stop()
            node.server.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
