"""The proxy's own subcommands: `serve` and `check-config`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import Any

from rich.console import Console
from rich.pretty import Pretty

from proxy.config import ConfigError, config_to_dict, load_config


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="run the proxy in front of llama-server")
    serve.add_argument("--config", required=True, metavar="PATH", help="the TOML config file")
    serve.set_defaults(handler=run_serve)
    check = subparsers.add_parser("check-config", help="validate a config file and print it")
    check.add_argument("path", metavar="PATH")
    check.set_defaults(handler=run_check_config)


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"slotwise: config error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log.level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from proxy.app import serve

    try:
        _run(serve(config))
    except OSError as exc:
        print(f"slotwise: cannot listen on {config.listen.host}:{config.listen.port}: "
              f"{exc.strerror}", file=sys.stderr)
        return 1
    return 0


def run_check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.path)
    except ConfigError as exc:
        print(f"slotwise: config error: {exc}", file=sys.stderr)
        return 2
    console = Console()
    console.print(f"[green]{args.path}: valid[/green]; the effective config:")
    console.print(Pretty(config_to_dict(config)))
    return 0


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)
