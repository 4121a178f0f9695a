"""The `slotwise` command line: `main` dispatches to the subcommand modules."""

from proxy.cli.main import main

__all__ = ["main"]
