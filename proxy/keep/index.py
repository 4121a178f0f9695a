"""The files slotwise keeps in llama-server's save directory, on disk: the index (whose KV each file
holds, as block hashes and counts, never text), the files there, and what slotwise does to them
(private permissions, rename, delete, quarantine: `Shelf` applies the store's file decisions), and
the checks that a file is still the one saved (`seal` at save, `check` before a restore), and the
token ids a file holds (`kept_tokens`, what a restore will cache, to the token). Plain
synchronous file I/O (the keeper runs the slow parts in a thread); every error becomes a message.

llama-server aborts on a damaged state file (`GGML_ASSERT(nread <= state_size)` for a short one), so
a file is never handed to it unless its size and SHA-256 are those taken when it was saved. Files
and the index reach the disk before they are renamed (fsync of the file, then of the directory), so
a power loss leaves the old one or the new one, whole.

The index is `slotwise-keep-index.json` beside the files, written whole to a private temporary file
and renamed. Its chains are Python's tuple hashes of
token ids (`block_hashes`): stable across processes of one Python version, so the index names that
version and an index of another is ignored (its files are then deleted as unknown).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from proxy.keep.values import (
    QUARANTINE_SUFFIX,
    Delete,
    KeepDecision,
    KeepFile,
    Quarantine,
    SavedFile,
    is_ours,
    is_quarantined,
)

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
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
        sync_dir(directory)
    except OSError as exc:
        raise IndexUnusable(f"cannot write {path}: {exc.strerror}") from exc


def sync_dir(directory: Path) -> None:
    """fsync a directory, so a rename in it survives a power loss (OSError when it cannot)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Stamp:
    """What a file looked like when its bytes were last hashed: unchanged size, mtime and inode
    mean unchanged bytes (a write, a truncation or a replacement changes one of them)."""

    size: int
    mtime_ns: int
    inode: int


def stamp(path: Path) -> Stamp:
    """OSError when the file cannot be read."""
    st = path.stat()
    return Stamp(st.st_size, st.st_mtime_ns, st.st_ino)


def seal(path: Path) -> tuple[int, str, Stamp]:
    """A fresh save's size and SHA-256, after forcing it to disk; OSError when it cannot be read."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        os.fsync(f.fileno())
    found = stamp(path)
    return found.size, digest, found


@dataclass(frozen=True)
class Checked:
    """What `check` found: `problem` None when the file holds the bytes saved; then its `stamp`
    and `digest` (the one found, for an index entry that had none)."""

    problem: str | None
    stamp: Stamp | None = None
    digest: str = ""


def check(path: Path, saved: SavedFile, seen: Stamp | None) -> Checked:
    """Whether the file still holds the bytes saved. A file whose stamp is `seen` (hashed since,
    unchanged) is not read again. An index entry with no digest (written by an older slotwise)
    passes on its size and gets the digest found."""
    try:
        now = stamp(path)
        if now.size != saved.size:
            return Checked(f"{now.size} bytes on disk, {saved.size} saved")
        if seen == now and saved.digest:
            return Checked(None, now, saved.digest)
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        return Checked(f"cannot read it: {exc.strerror}")
    if saved.digest and digest != saved.digest:
        return Checked("its bytes are not the ones saved (its SHA-256 differs)")
    return Checked(None, now, digest)


STATE_MAGIC = 0x67677371
"""llama.cpp's `LLAMA_STATE_SEQ_MAGIC` ('ggsq'): a slot's save file starts with it, its version and
a count of 32-bit words (little-endian u32s), then those words, then the KV. In version 2 the words
are the slot's token ids; in version 4 (the testbed's build, b11434) they are -1, 1, the number of
ids, the ids, then 0 (read off files it saved)."""
TOKEN_NULL = -1
"""`LLAMA_TOKEN_NULL`: never a token id; a version-4 head starts with it."""
MAX_WORDS = 1 << 22
"""More words than any slot's context holds: a head that says more is not read (16 MiB)."""


def kept_tokens(path: Path) -> list[int] | None:
    """The token ids a slot's save file holds (the slot's prompt and the reply after it), read
    from its head; None when its head is of no form known here, or it cannot be read. Numbers in
    memory only: they are the conversation, as the KV beside them is."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12:
                return None
            magic, _version, count = struct.unpack("<III", head)
            if (magic != STATE_MAGIC or count > MAX_WORDS
                    or 12 + 4 * count > os.fstat(f.fileno()).st_size):
                return None
            raw = f.read(4 * count)
    except OSError:
        return None
    if len(raw) != 4 * count:
        return None
    words = struct.unpack(f"<{count}i", raw)
    if words and words[0] == TOKEN_NULL:
        if len(words) < 3 or not 0 <= words[2] <= len(words) - 3:
            return None
        words = words[3:3 + words[2]]
    return list(words) if all(w >= 0 for w in words) else None


def quarantined(directory: Path) -> list[str]:
    """The files slotwise set aside after a restore of them got no answer."""
    try:
        return sorted(e.name for e in os.scandir(directory) if is_quarantined(e.name))
    except OSError:
        return []


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

    def apply(self, decisions: Iterable[KeepDecision], files: Iterable[SavedFile]) -> list[str]:
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
            elif isinstance(decision, Quarantine):
                changed = True
                self._quarantine(decision)
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

    def _quarantine(self, decision: Quarantine) -> None:
        target = decision.name + QUARANTINE_SUFFIX
        log.warning("keep_kv: %s set aside as %s: %s", decision.name, target, decision.reason)
        try:
            rename(self.dir, decision.name, target)
        except OSError as exc:
            self.report(f"cannot quarantine {decision.name} in {self.dir} ({exc.strerror}): "
                        "deleting it instead")
            delete(self.dir, decision.name)

    def _keep(self, keep: KeepFile) -> bool:
        if (problem := make_private(self.dir / keep.temp)) is not None:
            self.report(problem)
        try:
            rename(self.dir, keep.temp, keep.name)
        except OSError as exc:
            self.report(f"cannot rename {keep.temp} in {self.dir}: {exc.strerror}")
            delete(self.dir, keep.temp)
            return False
        try:
            sync_dir(self.dir)
        except OSError as exc:
            self.report(f"cannot sync {self.dir} ({exc.strerror}): a power loss may lose a save")
        return True
