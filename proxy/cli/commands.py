"""The proxy's own subcommands: `serve`, `check-config` and `reload`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.pretty import Pretty

from proxy.config import Config, ConfigError, config_to_dict, load_config


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="run the proxy in front of llama-server")
    serve.add_argument("--config", required=True, metavar="PATH", help="the TOML config file")
    serve.set_defaults(handler=run_serve)
    check = subparsers.add_parser("check-config", help="validate a config file and print it")
    check.add_argument("path", metavar="PATH")
    check.set_defaults(handler=run_check_config)
    reload = subparsers.add_parser(
        "reload", help="make a running slotwise re-read its config file (sends it SIGHUP)")
    reload.add_argument("--config", required=True, metavar="PATH",
                        help="the config file; checked first, and its [listen] finds slotwise")
    reload.add_argument("--url", help="slotwise's URL, if not the config's listen address")
    reload.set_defaults(handler=run_reload)


def _load(path: str, consequence: str = "") -> Config | None:
    """The config at `path`, or None after saying on stderr what is wrong with it."""
    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"slotwise: config error: {exc}{consequence}", file=sys.stderr)
        return None


def run_serve(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return 2
    logging.basicConfig(level=config.log.level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from proxy.app import serve

    try:
        _run(serve(config, config_path=args.config))
    except ConfigError as exc:  # found at start, e.g. an adapter the server does not have
        print(f"slotwise: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"slotwise: cannot listen on {config.listen.host}:{config.listen.port}: "
              f"{exc.strerror}", file=sys.stderr)
        return 1
    return 0


def run_check_config(args: argparse.Namespace) -> int:
    config = _load(args.path)
    if config is None:
        return 2
    console = Console()
    console.print(f"[green]{args.path}: valid[/green]; the effective config:")
    console.print(Pretty(config_to_dict(config)))
    return 0


def run_reload(args: argparse.Namespace) -> int:
    """Check the file, signal the slotwise listening where it says, and report what it did."""
    config = _load(args.config, "\nslotwise: nothing was reloaded")
    if config is None:
        return 2
    if config.listen.port == 0 and not args.url:
        print("slotwise: listen.port is 0 (a port the system picks): give slotwise's URL "
              "with --url", file=sys.stderr)
        return 2
    host = config.listen.host if config.listen.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    url = (args.url or f"http://{host}:{config.listen.port}").rstrip("/") + "/slotwise/status"
    headers = _page_auth(config)
    try:
        before = _get_status(url, headers)
    except urllib.error.HTTPError as exc:
        print(f"slotwise: {url} answered {exc.code}: {_refused(exc, config)}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"slotwise: no slotwise answers at {url}: {exc}", file=sys.stderr)
        return 1
    running = before.get("config_path")
    if running and Path(running).resolve() != Path(args.config).resolve():
        print(f"slotwise: note: the running slotwise re-reads {running}, not {args.config}",
              file=sys.stderr)
    try:
        os.kill(int(before["pid"]), signal.SIGHUP)
    except ProcessLookupError:
        print(f"slotwise: pid {before['pid']} is not running on this machine", file=sys.stderr)
        return 1
    except PermissionError:
        print(f"slotwise: not allowed to signal pid {before['pid']} (run as its user or root, "
              "or use `systemctl reload slotwise`)", file=sys.stderr)
        return 1
    return _await_reload(url, headers, int(before.get("reloads", 0)))


def _page_auth(config: Config) -> dict[str, str]:
    """The credentials for the status page the config gives: its pages token, else its admin key."""
    token = config.access.pages_token or config.access.admin_key
    return {"Authorization": f"Bearer {token}"} if token else {}


def _refused(error: urllib.error.HTTPError, config: Config) -> str:
    """Why the status page refused, and what to do: reload finds slotwise's pid there."""
    if error.code == 403:
        return ("the status page is off (access.pages; keys are in force or slotwise is not on "
                "loopback), and `slotwise reload` finds slotwise's pid there: set access.pages_token "
                "(or access.admin_key) in the config, or send the signal yourself: "
                "`kill -HUP <pid>` or `systemctl reload slotwise`")
    if error.code == 401:
        given = "the token in the config was refused" if _page_auth(config) else "it needs a token"
        return (f"{given}: the config given must hold the access.pages_token (or access.admin_key) "
                "of the running slotwise")
    return str(error.reason)


def _get_status(url: str, headers: dict[str, str]) -> dict[str, Any]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        status: dict[str, Any] = orjson.loads(response.read())
    return status


def _await_reload(url: str, headers: dict[str, str], reloads_before: int,
                  timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        status = _get_status(url, headers)
        last = status.get("last_reload")
        if int(status.get("reloads", 0)) > reloads_before and last:
            if last["ok"]:
                print(f"slotwise: reloaded: {last['message']}")
                return 0
            print(f"slotwise: reload refused, generation {last['config_gen']} stays in force: "
                  f"{last['message']}", file=sys.stderr)
            return 1
    print(f"slotwise: no answer to the reload within {timeout_s:g} s; see slotwise's log",
          file=sys.stderr)
    return 1


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
