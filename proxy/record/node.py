"""This node's name: `cluster.node`, else HOSTNAME:PORT. It is sent back on every response as
`X-Slotwise-Node` and written in every record's `node`, so a client behind a router, and a report
over several timing logs, know which node served a request."""

from __future__ import annotations

import functools
import socket

from proxy.config import Config

NODE_HEADER = "X-Slotwise-Node"


@functools.cache
def _hostname() -> str:
    return socket.gethostname() or "localhost"


def node_name(config: Config) -> str:
    """`cluster.node`, else this machine's host name and the configured listen port."""
    return config.cluster.node or f"{_hostname()}:{config.listen.port}"
