"""The file `prefill.learned_file` names: what slotwise learned of its llama-server (learned.py),
read once `/props` has told which server it is, written every SAVE_EVERY_S while something new was
learned, and at stop. Written whole to a temporary file that then replaces it (a crash leaves the
old file or the new one, never half), readable by slotwise's user only. It never stops slotwise:
a file it cannot read is left as it is, not written over (it may be somebody else's), and said
so in the log; learning then starts afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import orjson

from proxy.config import PrefillConfig
from proxy.prefill.estimator import Estimator
from proxy.prefill.learned import Learned, LearnedError, ServerKey, dump, parse
from proxy.prefill.policy import PrefillPolicy

log = logging.getLogger("slotwise.prefill")

SAVE_EVERY_S = 300.0
PROPS_RETRY_S = 5.0


class LearnedFile:
    """Loads into, and saves from, the policy and the estimator's cache model."""

    def __init__(self, path: str, policy: PrefillPolicy, estimator: Estimator,
                 n_batch: int) -> None:
        self.path = Path(path)
        self._policy = policy
        self._estimator = estimator
        self._n_batch = n_batch
        self._key: ServerKey | None = None
        self._writable = True
        self._saved: dict[str, Any] | None = None
        self.loaded = False
        """Whether the file was looked at (taken up or not), once the server was known."""
        self.status = "waiting for llama-server's /props"
        """What became of the file, for the status page."""

    async def run(self, config: PrefillConfig) -> None:
        """Load once the server is known, then save every SAVE_EVERY_S (cancelled at stop). The
        file is read and written in a thread; what it holds is taken from and given to the
        policy and the cache model on the event loop, which changes them."""
        while self._key is None:
            await self._estimator.slot_ctx(config)
            self._key = ServerKey.of(self._estimator.layout, self._n_batch)
            if self._key is None:
                await asyncio.sleep(PROPS_RETRY_S)
        try:
            raw = await asyncio.to_thread(_read, self.path)
        except OSError as exc:
            self._refuse(f"cannot be read ({exc.strerror or exc})")
        else:
            self.load(raw)
        self.loaded = True
        while True:
            await asyncio.sleep(SAVE_EVERY_S)
            await self.save()

    def load(self, raw: bytes | None) -> None:
        """Take up what the file's bytes hold (None: there is no file)."""
        if self._key is None:
            return
        if raw is None:
            self.status = "no file yet: learning afresh"
            return
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self._refuse(f"is not JSON ({exc})")
            return
        if not isinstance(data, dict) or "server" not in data:
            self._refuse("is not a file slotwise wrote")
            return
        try:
            learned, other = parse(data, self._key)
        except LearnedError as exc:  # slotwise's own, damaged: written over at the next save
            self.status = f"not read ({exc}): learning afresh"
            log.warning("prefill.learned_file %s: %s", self.path, self.status)
            return
        if learned is None:
            self.status = f"learned on {other}: learning afresh"
            log.info("prefill.learned_file %s: %s", self.path, self.status)
            return
        self._policy.adopt_learned(learned.batches, learned.narrow)
        self._estimator.cache.replies.adopt(learned.replies)
        self.status = f"taken up: {learned.summary()}"
        log.info("prefill.learned_file %s: %s", self.path, self.status)

    async def save(self) -> None:
        """Write what is learned now, if the server is known and anything changed."""
        if self._key is None or not self._writable:
            return
        batches, narrow = self._policy.learned()
        learned = Learned(batches, narrow, self._estimator.cache.replies.seen())
        data = dump(self._key, learned)
        if learned.empty or data == self._saved:
            return
        try:
            await asyncio.to_thread(_write, self.path, orjson.dumps(data))
        except OSError as exc:
            log.warning("prefill.learned_file %s: cannot be written (%s)", self.path,
                        exc.strerror or exc)
            return
        self._saved = data

    def _refuse(self, why: str) -> None:
        self._writable = False
        self.status = f"{why}: not read, and not written over"
        log.warning("prefill.learned_file %s %s: not read, and not written over; learning afresh "
                    "(move it away, or name another file)", self.path, why)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _write(path: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
