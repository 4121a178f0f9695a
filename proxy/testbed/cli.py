"""`slotwise testbed ...`: get the llama-server binary (building it once), write the testbed
model, or run a llama-server with that model in the foreground. Errors print one line, never a
traceback."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from proxy.testbed.binary import BinaryError, cache_root, find_llama_server
from proxy.testbed.cluster_cli import add_cluster
from proxy.testbed.model import PRESETS, write_model
from proxy.testbed.server import LlamaServer, ServerStartError


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "testbed", help="a real llama-server with a generated model, for tests and demos"
    )
    parser.set_defaults(handler=lambda _args: _usage(parser))
    commands = parser.add_subparsers(metavar="SUBCOMMAND")
    _add_server(commands)
    _add_model(commands)
    _add_run(commands)
    add_cluster(commands)


def _add_server(commands: argparse._SubParsersAction[Any]) -> None:
    server = commands.add_parser("server", help="print the llama-server binary path (builds once)")
    server.set_defaults(handler=_server)


def _add_model(commands: argparse._SubParsersAction[Any]) -> None:
    model = commands.add_parser("model", help="write the testbed model and LoRA adapter")
    model.add_argument("directory", type=Path, help="folder for the .gguf files")
    _add_model_options(model)
    model.set_defaults(handler=_model)


def _add_run(commands: argparse._SubParsersAction[Any]) -> None:
    run = commands.add_parser(
        "run",
        help="run llama-server with the testbed model in the foreground",
        description="Extra llama-server arguments go after `--`, e.g. "
        "`slotwise testbed run -- -np 2 -c 8192 --metrics`.",
    )
    _add_model_options(run)
    run.add_argument("--model-dir", type=Path, help="where to write the model (default: cache)")
    run.add_argument("--no-lora", action="store_true", help="do not load the LoRA adapter")
    run.add_argument("--log", type=Path, default=None, help="llama-server log file")
    run.add_argument("server_args", nargs="*", metavar="-- ARGS", help="passed to llama-server")
    run.set_defaults(handler=_run)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size")
    parser.add_argument("--seed", type=int, default=0, help="random seed (non-negative)")


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _server(args: argparse.Namespace) -> int:
    try:
        print(find_llama_server())
    except BinaryError as exc:
        return _fail(str(exc))
    return 0


def _model(args: argparse.Namespace) -> int:
    if args.seed < 0:
        return _fail(f"--seed must be non-negative, got {args.seed}")
    try:
        files = write_model(args.directory, args.preset, args.seed)
    except OSError as exc:
        return _fail(f"cannot write the model into {args.directory}: {exc}")
    print(files.model)
    print(files.lora)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.seed < 0:
        return _fail(f"--seed must be non-negative, got {args.seed}")
    directory = args.model_dir or cache_root() / "models"
    try:
        files = write_model(directory, args.preset, args.seed)
        server = LlamaServer(
            files.model,
            lora=None if args.no_lora else files.lora,
            args=args.server_args,
            log_path=args.log,
        )
        with _sigterm_as_interrupt(), server:
            print(f"llama-server ready at {server.url} (log: {server.log_path}); Ctrl-C stops it")
            sys.stdout.flush()
            code = server.wait()
    except (BinaryError, ServerStartError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot write the model into {directory}: {exc}")
    return _fail(f"llama-server exited with code {code}; log: {server.log_path}")


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    # Dying on SIGTERM (a service manager, `kill`) would orphan llama-server; unwinding stops it.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _fail(message: str) -> int:
    print(f"slotwise testbed: {message}", file=sys.stderr)
    return 1
