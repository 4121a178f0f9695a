"""llama-server's admin endpoints: those that change what every client gets, or show other clients'
requests. slotwise refuses them to clients unless `[access] allow` names them or the request carries
`[access] admin_key`; `config/access.py` checks `allow` against this table, `request/access.py` applies it.

From llama-server's route table (tools/server/server.cpp of the build the testbed runs). Its other
routes are the model endpoints, the tokenizer's, and read-only ones (`GET /props`, `GET
/lora-adapters`, `GET /models`, `/health`); its `GET /metrics` is never reached through slotwise,
which serves its own `/metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdminEndpoint:
    method: str
    path: str
    """The path; one ending in `/*` is every path under it (`/slots/0`, `/slots/3`, …)."""
    does: str
    """What it does, in words (the 403 answer, docs/security.md)."""

    @property
    def name(self) -> str:
        """How `[access] allow` names it, e.g. "POST /lora-adapters"."""
        return f"{self.method} {self.path}"

    def matches(self, method: str, path: str) -> bool:
        """`method` upper-case (HEAD counts as GET), `path` normalised (no query, no trailing /)."""
        if (method if method != "HEAD" else "GET") != self.method:
            return False
        if self.path.endswith("/*"):
            base = self.path[:-2]
            return path == base or path.startswith(base + "/")
        return path == self.path


ADMIN_ENDPOINTS: tuple[AdminEndpoint, ...] = (
    AdminEndpoint("POST", "/lora-adapters",
                  "sets the global LoRA scales of every later request (and undoes [lora] fixed)"),
    AdminEndpoint("POST", "/slots/*",
                  "saves, restores or erases a slot's cache (?action=save|restore|erase)"),
    AdminEndpoint("GET", "/slots", "shows every slot's task and parameters: other clients' requests"),
    AdminEndpoint("POST", "/props", "changes the server's properties"),
    AdminEndpoint("POST", "/models", "adds a model (router mode)"),
    AdminEndpoint("DELETE", "/models", "removes a model (router mode)"),
    AdminEndpoint("POST", "/models/load", "loads a model (router mode)"),
    AdminEndpoint("POST", "/models/unload", "unloads a model (router mode)"),
    AdminEndpoint("GET", "/cors-proxy", "fetches any URL from the server's host (web UI MCP proxy)"),
    AdminEndpoint("POST", "/cors-proxy", "fetches any URL from the server's host (web UI MCP proxy)"),
    AdminEndpoint("GET", "/tools", "lists the tools the server may run"),
    AdminEndpoint("POST", "/tools", "runs a tool on the server's host"),
)

ADMIN_NAMES: tuple[str, ...] = tuple(e.name for e in ADMIN_ENDPOINTS)
"""The values `[access] allow` takes."""
