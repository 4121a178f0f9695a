"""Whether saving works, found at start: llama-server must run with `--slot-save-path`, and that
directory must be `keep_kv.dir`, where slotwise can make files private and delete them.

The probe saves an idle slot (the emptiest: a save of an empty one writes a few bytes) to a probe
file, looks for it in `keep_kv.dir`, and deletes it. llama-server without `--slot-save-path` answers
every slot action with 501 ("This server does not support slots action"). The model's path from
`/props` comes along: files are only restored into the model they were saved from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from proxy.keep.index import delete, make_private
from proxy.keep.values import FILE_PREFIX, FILE_SUFFIX, PART_SUFFIX, read_slots
from proxy.upstream import UpstreamCallError, UpstreamClient

PROBE_FILE = f"{FILE_PREFIX}probe-{os.getpid()}{FILE_SUFFIX}{PART_SUFFIX}"
"""A name of slotwise's, so a probe file left behind is deleted at the next start."""
TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Probe:
    working: bool | None
    """None: not known yet (llama-server did not answer, or had no idle slot): ask again later."""
    note: str
    model: str | None = None
    private: bool = True
    """Whether slotwise could make the probe file private (it owns the files llama-server writes)."""


UNKNOWN = Probe(None, "not probed yet")


async def probe(upstream: UpstreamClient, directory: Path) -> Probe:
    try:
        props = await upstream.get_json("/props", timeout_s=TIMEOUT_S)
        slots = read_slots(await upstream.get_json("/slots", timeout_s=TIMEOUT_S))
    except (UpstreamCallError, ValueError) as exc:
        return Probe(None, f"cannot ask llama-server yet: {exc}")
    model = props.get("model_path") if isinstance(props, dict) else None
    if not isinstance(model, str):
        return Probe(False, "llama-server's /props names no model_path: files could not be told "
                            "apart by model, so keep_kv stays off")
    idle = sorted((s for s in slots if not s.busy), key=lambda s: s.tokens)
    if not idle:
        return Probe(None, "no idle slot to probe with yet", model)
    try:
        await upstream.post_json(f"/slots/{idle[0].id}?action=save", {"filename": PROBE_FILE},
                                 timeout_s=TIMEOUT_S)
    except UpstreamCallError as exc:
        return Probe(None if exc.status is None else False, save_refused(exc), model)
    return _found(directory, model)


def save_refused(exc: UpstreamCallError) -> str:
    """Why a save was refused, and what to do."""
    if exc.status == 501:
        return ("llama-server runs without --slot-save-path (it answered 501 to a save): start it "
                "with --slot-save-path set to keep_kv.dir; keep_kv stays off")
    if exc.status is None:
        return f"the probe save got no answer: {exc}"
    return f"llama-server refused the probe save: {exc}; keep_kv stays off"


def _found(directory: Path, model: str) -> Probe:
    path = directory / PROBE_FILE
    if not path.exists():
        return Probe(False, f"llama-server saved the probe file, but not in keep_kv.dir "
                            f"({directory}): set keep_kv.dir to the directory given as "
                            "--slot-save-path; keep_kv stays off", model)
    private = make_private(path)
    problem = delete(directory, PROBE_FILE)
    if problem is not None:
        return Probe(False, f"{problem}: slotwise must be able to delete files in keep_kv.dir; "
                            "keep_kv stays off", model)
    if private is None and directory.stat().st_mode & 0o007:
        private = (f"{directory} is open to every user (mode {directory.stat().st_mode & 0o777:o}): "
                   "chmod 700 it (docs/keep-kv.md)")
    if private is not None:
        return Probe(True, f"saving works in {directory}, but {private}", model, private=False)
    return Probe(True, f"saving works in {directory}", model)
