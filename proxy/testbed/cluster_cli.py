"""`slotwise testbed cluster --nodes N`: N testbed llama-servers, a slotwise in front of each and
vllm-router in front of them all, on loopback, until Ctrl-C. Errors print one line."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from proxy.testbed.args import positive_int
from proxy.testbed.binary import BinaryError
from proxy.testbed.cluster import POLICIES, Cluster, RouterMissing
from proxy.testbed.server import ServerStartError


def add_cluster(commands: argparse._SubParsersAction[Any]) -> None:
    cluster = commands.add_parser(
        "cluster", help="N llama-servers, N slotwise and vllm-router in front, until Ctrl-C",
        description="Starts N testbed llama-servers (tiny model), a slotwise in front of each "
        "(nodes node1..N) and vllm-router in front of them all, and prints the router's URL. "
        "Extra llama-server arguments go after `--` (default: -np 4 -c 8192).")
    cluster.add_argument("--nodes", type=positive_int, default=2, help="how many nodes (default 2)")
    cluster.add_argument("--policy", choices=POLICIES, default="cache_aware",
                         help="the router's policy (default cache_aware; docs/scale-out.md)")
    cluster.add_argument("--prefill", choices=("off", "defer", "chunk"), default="off",
                         help="every slotwise's [prefill] mode (default off)")
    cluster.add_argument("--work-dir", type=Path, default=None,
                         help="where the logs go (default: a new temporary folder)")
    cluster.add_argument("server_args", nargs="*", metavar="-- ARGS", help="passed to llama-server")
    cluster.set_defaults(handler=run_cluster)


def run_cluster(args: argparse.Namespace) -> int:
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="slotwise-cluster-"))
    cluster = Cluster(args.nodes, work_dir, policy=args.policy,
                      tables={"prefill": {"mode": args.prefill}})
    if args.server_args:
        cluster.server_args = tuple(args.server_args)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with cluster:
            _describe(cluster)
            threading.Event().wait()  # until Ctrl-C (KeyboardInterrupt) or SIGTERM
    except (RouterMissing, BinaryError, ServerStartError, RuntimeError) as exc:
        print(f"slotwise testbed cluster: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _describe(cluster: Cluster) -> None:
    print(f"router ready at {cluster.router.url} (policy {cluster.policy}, log "
          f"{cluster.router.log_path}); Ctrl-C stops everything")
    for node in cluster.nodes:
        print(f"  {node.name}: slotwise {node.url} -> llama-server {node.server.url}; timing log "
              f"{node.slotwise.timing_path}")
    logs = " ".join(str(n.slotwise.timing_path) for n in cluster.nodes)
    print(f"report over all nodes: slotwise report {logs}")
    sys.stdout.flush()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
