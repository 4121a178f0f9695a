"""The `slotwise` command line: parses arguments and dispatches to the subcommands.

Each subcommand group lives in its own module, which exposes `register(subparsers)`; the parser it
adds sets `handler`, a function of the parsed arguments that returns the exit code. This is the only
module that exits.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from proxy import __version__

# Modules that add subcommands, in the order `slotwise --help` lists them.
COMMAND_MODULES = (
    "proxy.cli.commands",
    "proxy.cli.demo",
    "proxy.testbed.cli",
    "proxy.bench.cli",
    "proxy.report.cli",
    "proxy.whatif.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slotwise",
        description="A reverse proxy for llama-server that keeps every user's reply flowing "
        "and times every request.",
    )
    parser.add_argument("--version", action="version", version=f"slotwise {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise
            continue  # a subcommand group not built yet
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(handler(args))
    except KeyboardInterrupt:
        return 130
