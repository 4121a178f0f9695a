"""The files slotwise keeps in llama-server's save directory, on disk: the index (whose KV each file
holds, as block hashes and counts, never text), the files there, and what slotwise does to them
(private permissions, rename, delete: `Shelf` applies the store's file decisions). Plain synchronous
file I/O; every error becomes a message.

The index is `slotwise-keep-index.json` beside the files, written whole to a private temporary file
and renamed, so a crash leaves the old one or the new one. Its chains are Python's tuple hashes of
token ids (`block_hashes`): stable across processes of one Python version, so the index names that
version and an index of another is ignored (its files are then deleted as unknown).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from proxy.keep.values import Decision, Delete, KeepFile, SavedFile, is_ours

log = logging.getLogger("slotwise.keep")

INDEX_NAME = "slotwise-keep-index.json"
HASHES = f"python-tuple-hash-{sys.version_info[0]}.{sys.version_info[1]}"
"""What the chains in the index were made with (see the module docstring)."""
PRIVATE = 0o600


class IndexUnusable(Exception):
    """The index cannot be read or written; the message says why."""


def load_index(directory: Path) -> list[SavedFile]:
    """The files the index lists; [] when there is none, or it was made with other hashes.
    IndexUnusable when it exists but cannot be read."""
    path = directory / INDEX_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise IndexUnusable(f"cannot read {path}: {exc.strerror}") from exc
    try:
        data: Any = orjson.loads(raw)
        if data.get("hashes") != HASHES:
            return []
        return [SavedFile.from_json(entry) for entry in data["files"]]
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise IndexUnusable(f"{path} is not an index slotwise wrote: {exc}") from exc


def write_index(directory: Path, files: list[SavedFile]) -> None:
    """Replace the index with `files` (IndexUnusable when it cannot be written)."""
    path = directory / INDEX_NAME
    temp = directory / (INDEX_NAME + ".tmp")
    body = orjson.dumps({"hashes": HASHES, "files": [f.to_json() for f in files]})
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE)
        with os.fdopen(fd, "wb") as out:
            out.write(body)
        os.replace(temp, path)
    except OSError as exc:
        raise IndexUnusable(f"cannot write {path}: {exc.strerror}") from exc


def files_on_disk(directory: Path) -> dict[str, int]:
    """slotwise's files in `directory` (`values.is_ours`), name -> size; others' files are not listed."""
    found: dict[str, int] = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in entries:
        if is_ours(entry.name):
            try:
                found[entry.name] = entry.stat().st_size
            except OSError:
                continue
    return found


def make_private(path: Path) -> str | None:
    """chmod 0600; the problem as text if slotwise may not (it does not own the file)."""
    try:
        os.chmod(path, PRIVATE)
    except OSError as exc:
        return (f"cannot make {path.name} private ({exc.strerror}): run llama-server as slotwise's "
                "user or with umask 077 (docs/keep-kv.md)")
    return None


def rename(directory: Path, temp: str, name: str) -> None:
    """OSError when it cannot."""
    os.replace(directory / temp, directory / name)


def delete(directory: Path, name: str) -> str | None:
    """Delete a file (gone already is fine); the problem as text otherwise."""
    try:
        (directory / name).unlink(missing_ok=True)
    except OSError as exc:
        return f"cannot delete {name} in {directory}: {exc.strerror}"
    return None


def file_size(directory: Path, name: str) -> int | None:
    try:
        return (directory / name).stat().st_size
    except OSError:
        return None


class Shelf:
    """The save directory as the keeper uses it: applies `KeepFile` and `Delete`, keeps the index
    in step, and remembers the last problem (the status page; each new one is logged once)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.problem: str | None = None

    def load(self) -> tuple[list[SavedFile], dict[str, int]]:
        """The index (none if it cannot be read: a problem) and slotwise's files on disk."""
        try:
            files = load_index(self.dir)
        except IndexUnusable as exc:
            self.report(f"{exc}: starting with no saved conversations")
            files = []
        return files, files_on_disk(self.dir)

    def apply(self, decisions: Iterable[Decision], files: Iterable[SavedFile]) -> list[str]:
        """Apply the file decisions, then write the index of `files` if anything changed; the names
        of files that could not be kept (the caller forgets them)."""
        lost: list[str] = []
        changed = False
        for decision in decisions:
            if isinstance(decision, KeepFile):
                changed = True
                if not self._keep(decision):
                    lost.append(decision.name)
            elif isinstance(decision, Delete):
                changed = True
                log.info("keep_kv: deleting %s: %s", decision.name, decision.reason)
                if (problem := delete(self.dir, decision.name)) is not None:
                    self.report(problem)
        if changed:
            self.write([f for f in files if f.name not in lost])
        return lost

    def write(self, files: list[SavedFile]) -> None:
        try:
            write_index(self.dir, files)
        except IndexUnusable as exc:
            self.report(str(exc))

    def report(self, problem: str) -> None:
        if problem != self.problem:
            log.warning("keep_kv: %s", problem)
        self.problem = problem

    def _keep(self, keep: KeepFile) -> bool:
        if (problem := make_private(self.dir / keep.temp)) is not None:
            self.report(problem)
        try:
            rename(self.dir, keep.temp, keep.name)
        except OSError as exc:
            self.report(f"cannot rename {keep.temp} in {self.dir}: {exc.strerror}")
            delete(self.dir, keep.temp)
            return False
        return True
