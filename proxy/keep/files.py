"""The kept files on disk, as the keeper handles them: the shelf (the directory and its index), each
file's stamp when its bytes were last hashed, the check of every file at start and of one before
its restore (hashing in a thread: llama-server aborts on a damaged file), a save's seal, and the
keep store's file decisions applied (renames, deletes, quarantines, the index rewritten).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from proxy.keep import index
from proxy.keep.store import KeepStore
from proxy.keep.values import KeepDecision, RestoreInto, SavedFile

log = logging.getLogger("slotwise.keep")


class KeptFiles:
    def __init__(self, directory: Path, store: KeepStore) -> None:
        self.shelf = index.Shelf(directory)
        self.store = store
        self._stamps: dict[str, index.Stamp] = {}
        """Each file's stamp when its bytes were last hashed (unchanged: not hashed again)."""

    @property
    def dir(self) -> Path:
        return self.shelf.dir

    def load(self, now: float) -> None:
        """The index and the files on disk (rule 10 of the store)."""
        files, on_disk = self.shelf.load()
        self.apply(self.store.load(files, on_disk, now))

    def apply(self, decisions: Sequence[KeepDecision]) -> None:
        """The store's decisions about files (the others are ignored here)."""
        self.store.forget(self.shelf.apply(decisions, list(self.store.files.values())))

    def write_index(self) -> None:
        self.shelf.write(list(self.store.files.values()))

    async def check_all(self) -> None:
        """Hash every kept file once (in a thread, most recently used first): a damaged one is
        deleted now rather than found when its conversation returns."""
        adopted = False
        for saved in sorted(self.store.files.values(), key=lambda f: -f.last_used):
            checked = await asyncio.to_thread(index.check, self.dir / saved.name, saved, None)
            adopted |= self._checked(saved, checked)
            if checked.problem is not None:
                self._damaged(saved.name, checked.problem)
        if adopted:
            self.write_index()
        if names := index.quarantined(self.dir):
            self.shelf.report(f"{len(names)} quarantined files in {self.dir} (their restore "
                              f"left llama-server without an answer): {', '.join(names[:3])}; look "
                              "at them or delete them")

    async def check(self, restore: RestoreInto) -> str | None:
        """Whether the file still holds the bytes saved; what is wrong with it (then deleted, and
        the restore released)."""
        saved = self.store.files.get(restore.name)
        if saved is None:  # deleted meanwhile
            self.store.release(restore)
            return "deleted meanwhile"
        try:
            checked = await asyncio.to_thread(index.check, self.dir / saved.name, saved,
                                              self._stamps.get(saved.name))
        except BaseException:
            self.store.release(restore)
            raise
        if self._checked(saved, checked):
            self.write_index()
        if checked.problem is None:
            return None
        self._damaged(saved.name, checked.problem)
        return checked.problem

    async def tokens(self, name: str) -> list[int] | None:
        """The token ids the file holds (None: unreadable, or not a slot's save)."""
        return await asyncio.to_thread(index.kept_tokens, self.dir / name)

    async def seal(self, temp: str, name: str) -> tuple[int, str]:
        """A save's file synced and hashed before its rename: its size and digest (OSError)."""
        size, digest, stamp = await asyncio.to_thread(index.seal, self.dir / temp)
        self._stamps[name] = stamp
        return size, digest

    def _checked(self, saved: SavedFile, checked: index.Checked) -> bool:
        """Remember a good check's stamp; True when it gave an index entry its first digest."""
        if checked.stamp is None or self.store.files.get(saved.name) is not saved:
            return False
        self._stamps[saved.name] = checked.stamp
        adopted = not saved.digest
        saved.digest = checked.digest
        return adopted

    def _damaged(self, name: str, problem: str) -> None:
        log.warning("keep_kv: %s is damaged (%s): deleting it", name, problem)
        self.apply(self.store.on_damaged(name, problem))
