"""Who may do what: a request's method, path and credentials against the `[access]` config in force
give `Allow` (with the client's name) or `Refuse` (401 or 403, and what to do about it). Pure: the
handler asks `decide` before it reads a byte of the body; slotwise's own pages ask `decide_page`.

Rules of `decide` (tests/test_access.py follows them one to one):
1. CORS preflights (OPTIONS) and `GET /health`, `/v1/health` need no key, as in llama-server. Its
   web UI's files need none either: llama-server lets pass `/` and each file its build embeds
   (`get_public_endpoints` in tools/server/server-http.cpp), a list slotwise cannot know. So a
   `GET`/`HEAD` without a known key for `/` or a file name (a last segment with a dot) that is none
   of llama-server's API routes goes upstream with no credentials at all, and llama-server answers
   it as it answers anyone: its UI's files, or (with its own --api-key) its own 401.
2. With client keys (`access.clients`), every other request must carry one of them or the admin
   key, as `Authorization: Bearer KEY` or `x-api-key: KEY`; else 401. The key's name is the client.
3. Without client keys but with `[upstream] api_key`, it must carry that key or the admin key; else
   401. slotwise checks it itself, so no work is done for a client that would get 401 anyway.
4. Without either, no key is needed.
5. An admin endpoint (`proxy/config/admin_endpoints.py`) is refused with 403 unless the request
   carries the admin key or `access.allow` names it.
6. When keys are checked (rules 2 and 3), or the admin key was sent, the request goes upstream with
   the upstream's key instead of the client's credentials: clients never hold the server's key, and
   the server never sees theirs.
Keys are compared in constant time (`hmac.compare_digest`), each candidate against every key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import ipaddress
import posixpath
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from multidict import CIMultiDict

from proxy.config import ADMIN_CLIENT, AccessConfig, Config
from proxy.config.admin_endpoints import ADMIN_ENDPOINTS, AdminEndpoint
from proxy.request.errors import Forbidden, ProxyError, Unauthorized

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
"""What llama-server answers without a key, besides its web UI's files."""
API_GET_ROUTES = ("/metrics", "/props", "/models", "/lora-adapters", "/slots", "/cors-proxy",
                  "/tools", "/v1")
"""llama-server's GET routes that are not files (tools/server/server.cpp: `/models/sse`,
`/v1/models` and `/v1/stream` are below two of them), and everything below them: never a UI file."""
API_CHALLENGE = 'Bearer realm="slotwise"'
PAGES_CHALLENGE = 'Basic realm="slotwise pages", charset="UTF-8"'
"""Basic, so that a browser asks for the token (as the password) and sends it on every poll."""
_UPSTREAM = "\0upstream"  # who holds the upstream's key: nobody by name


@dataclass(frozen=True)
class Allow:
    client: str | None = None
    """The name of the key the request carried (the record's `client`); None: no key named it."""
    swap_credentials: bool = False
    """Rule 6: forward with the upstream's key instead of the client's Authorization/x-api-key."""
    strip_credentials: bool = False
    """Rule 1, a web UI file: forward with no credentials at all (llama-server's own check decides)."""

    def upstream_auth(self, server: Mapping[str, str]) -> Mapping[str, str] | None:
        """The credentials to forward instead of the client's (`server`: the upstream's key), or
        None to forward the client's as sent."""
        if self.strip_credentials:
            return {}
        return server if self.swap_credentials else None


@dataclass(frozen=True)
class Refuse:
    status: int
    message: str
    challenge: str | None = None
    """`WWW-Authenticate` of a 401."""

    def error(self) -> ProxyError:
        if self.status == 401:
            return Unauthorized(self.message, challenge=self.challenge or API_CHALLENGE)
        return Forbidden(self.message)


def decide(access: AccessConfig, upstream_key: str, method: str, raw_path: str,
           headers: Mapping[str, str]) -> Allow | Refuse:
    """May this request go upstream? `raw_path` as received (query and %-escapes included)."""
    method, paths = method.upper(), normal_paths(raw_path)
    keys = [(client.name, client.key) for client in access.clients]
    if upstream_key and not access.clients:
        keys.append((_UPSTREAM, upstream_key))
    if access.admin_key:
        keys.append((ADMIN_CLIENT, access.admin_key))
    given = presented(headers)
    holder = key_holder(given, keys)
    keys_checked = bool(access.clients) or bool(upstream_key)
    allow = Allow(client=None if holder in (None, _UPSTREAM) else holder,
                  swap_credentials=keys_checked or holder == ADMIN_CLIENT)
    reading = method in ("GET", "HEAD")
    if method == "OPTIONS" or (reading and paths <= PUBLIC_PATHS):
        return allow
    if keys_checked and holder is None:
        if reading and all(ui_file(path) for path in paths):
            return Allow(strip_credentials=True)
        return Refuse(401, _missing_key(access, bool(given)), API_CHALLENGE)
    endpoint = admin_endpoint(method, paths)
    if endpoint is not None and holder != ADMIN_CLIENT and endpoint.name not in access.allow:
        return Refuse(403, f"{endpoint.name} {endpoint.does}: slotwise refuses it to clients. To let "
                      f"every client call it, add \"{endpoint.name}\" to [access] allow; or send "
                      "[access] admin_key with the request (docs/security.md)")
    return allow


def _missing_key(access: AccessConfig, sent: bool) -> str:
    which = ("a key of [access] clients" if access.clients
             else "the key of [upstream] api_key (llama-server's --api-key)")
    what = "the key sent is not known" if sent else "this request carries no key"
    return f"{what}: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY') with {which}"


def ui_file(path: str) -> bool:
    """Whether a normal path may be one of llama-server's web UI files: `/`, or a file name (its last
    segment has a dot) that is neither one of its API routes nor below one."""
    if path == "/":
        return True
    if any(path == route or path.startswith(route + "/") for route in API_GET_ROUTES):
        return False
    return "." in path.rsplit("/", 1)[-1]


def admin_endpoint(method: str, paths: set[str]) -> AdminEndpoint | None:
    return next((e for e in ADMIN_ENDPOINTS for p in paths if e.matches(method, p)), None)


def normal_paths(raw_path: str) -> set[str]:
    """The path as llama-server may route it: without query, with and without %-escapes decoded
    (`/slots%2F0`), slashes merged, dot segments resolved, no trailing slash. Refusing on any
    of them errs on the side of refusing."""
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    found = set()
    for candidate in (path, unquote(path)):
        merged = re.sub(r"/{2,}", "/", "/" + candidate)
        found.add(posixpath.normpath(merged).rstrip("/") or "/")
    return found


def presented(headers: Mapping[str, str], *, basic: bool = False) -> list[str]:
    """The credentials a request carries: a Bearer token, an `x-api-key`, and with `basic` the
    password of Basic auth (a browser's way to send the pages' token)."""
    found = []
    scheme, _, value = headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        found.append(value.strip())
    elif basic and scheme.lower() == "basic":
        with contextlib.suppress(binascii.Error, UnicodeDecodeError):  # else refused like a wrong one
            found.append(base64.b64decode(value.strip(), validate=True).decode().partition(":")[2])
    api_key = headers.get("x-api-key", "").strip()
    if api_key:
        found.append(api_key)
    return found


def key_holder(given: Sequence[str], keys: Sequence[tuple[str, str]]) -> str | None:
    """The name of the key one of `given` is, comparing every pair in constant time."""
    holder = None
    for candidate in given:
        raw = candidate.encode("utf-8", "surrogatepass")
        for name, key in keys:
            if hmac.compare_digest(raw, key.encode()) and holder is None:
                holder = name
    return holder


def forwarded_headers(headers: CIMultiDict[str], upstream_auth: Mapping[str, str]) -> CIMultiDict[str]:
    """Rule 6: the headers to forward, the client's credentials replaced by the upstream's key."""
    swapped = CIMultiDict((k, v) for k, v in headers.items()
                          if k.lower() not in ("authorization", "x-api-key"))
    swapped.update(upstream_auth)
    return swapped


# -- slotwise's own answers: the load, the pages ------------------------------------------------------

def decide_load(config: Config, path: str, headers: Mapping[str, str]) -> Allow | Refuse:
    """May this request read the node's load (`GET /get_load`)? Where keys are in force (`[access]
    clients`, `[upstream] api_key`), it must carry one of them (a router's), the admin key or the
    pages token: the load tells anyone how busy the node is and how many requests it holds. llama-
    server has no such endpoint; its `/health` is public even with `--api-key`, and so is slotwise's."""
    access, upstream_key = config.access, config.upstream.api_key
    if not (access.clients or upstream_key):
        return Allow()
    keys = [(client.name, client.key) for client in access.clients]
    if upstream_key and not access.clients:
        keys.append((_UPSTREAM, upstream_key))
    keys += [(name, secret) for name, secret in (("pages", access.pages_token),
                                                 (ADMIN_CLIENT, access.admin_key)) if secret]
    holder = key_holder(presented(headers), keys)
    if holder is None:
        which = "a key of [access] clients" if access.clients else "the key of [upstream] api_key"
        return Refuse(401, f"{path} needs a key where keys are in force: send 'Authorization: "
                      f"Bearer KEY' with {which}, [access] admin_key or pages_token", API_CHALLENGE)
    return Allow(client=None if holder == _UPSTREAM else holder)


def is_loopback(host: str) -> bool:
    """Whether slotwise listens only where nobody but this machine can connect."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def pages_mode(config: Config) -> str:
    """open, token or off: `access.pages`, with auto resolved. Auto is token when a token is set,
    open only on a loopback address where no key is in force (else keys say not everyone here is
    trusted), off otherwise."""
    access = config.access
    if access.pages != "auto":
        return access.pages
    if access.pages_token or access.admin_key:
        return "token"
    keys = bool(access.clients) or bool(config.upstream.api_key)
    return "open" if is_loopback(config.listen.host) and not keys else "off"


def decide_page(config: Config, path: str, headers: Mapping[str, str]) -> Allow | Refuse:
    """May this request see one of slotwise's pages (/metrics, /slotwise/)? Its `client` is who
    showed the token: "pages" or "admin"."""
    access, mode = config.access, pages_mode(config)
    if mode == "open":
        return Allow()
    if mode == "off":
        return Refuse(403, f"{path} is off: {_pages_off(config)}. To see it, set access.pages_token "
                      "and send it as 'Authorization: Bearer TOKEN' (Prometheus: "
                      "authorization.credentials), or set access.pages = 'open' (docs/security.md)")
    tokens = [(name, secret) for name, secret in (("pages", access.pages_token),
                                                  (ADMIN_CLIENT, access.admin_key)) if secret]
    holder = key_holder(presented(headers, basic=True), tokens)
    if holder is None:
        return Refuse(401, f"{path} needs the token of access.pages_token (or access.admin_key): "
                      "send 'Authorization: Bearer TOKEN', or give it as the password in a browser",
                      PAGES_CHALLENGE)
    return Allow(client=holder)


def _pages_off(config: Config) -> str:
    host = config.listen.host
    if config.access.pages == "off":
        return "access.pages is 'off'"
    if not is_loopback(host):
        return f"slotwise listens on {host}, not a loopback address, and no access.pages_token is set"
    return "keys are in force ([access] clients or [upstream] api_key) and no access.pages_token is set"


def exposure(config: Config) -> str | None:
    """One line saying what anyone who can reach slotwise may do, when it listens beyond loopback
    and something is open without a key; None when nothing is."""
    host, access = config.listen.host, config.access
    if is_loopback(host):
        return None
    keyless = not (access.clients or config.upstream.api_key)
    open_parts = ["the model endpoints", *access.allow] if keyless else []
    mode = pages_mode(config)
    if mode == "open":
        open_parts.append("the pages /metrics and /slotwise/ (other clients' requests)")
    if not open_parts:
        return None
    pages = {"open": "", "token": "; pages need access.pages_token", "off": "; pages off"}[mode]
    return (f"slotwise listens on {host}, not loopback: anyone who can reach it may use "
            f"{', '.join(open_parts)} without a key{pages}; require keys with [access] clients "
            "(docs/security.md)")
