"""The disk budget of the saved files: which to delete so that the rest fits. Pure.

Age first (a file not saved or restored for `max_age_s`), then count and total size, least recently
used first (a save or a restore is a use; fewer restores go first among equals, then the older save).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from proxy.keep.values import Delete, KeepKnobs, SavedFile


def eviction_order(files: Iterable[SavedFile]) -> list[SavedFile]:
    """Least recently used first."""
    return sorted(files, key=lambda f: (f.last_used, f.uses, f.saved_at, f.name))


def over_budget(files: Iterable[SavedFile], knobs: KeepKnobs, now: float,
                protected: Collection[str] = ()) -> list[Delete]:
    """The files to delete so the others fit `knobs`; `protected` ones (a restore reading them) stay."""
    deletes: list[Delete] = []
    kept: list[SavedFile] = []
    for f in eviction_order(files):
        if f.name not in protected and now - f.last_used > knobs.max_age_s:
            days = (now - f.last_used) / 86400.0
            deletes.append(Delete(f.name, f"not used for {days:.1f} days (keep_kv.max_age_days)"))
        else:
            kept.append(f)
    count, total = len(kept), sum(f.size for f in kept)
    for f in kept:
        if count <= knobs.max_files and total <= knobs.max_bytes:
            break
        if f.name in protected:
            continue
        why = ("keep_kv.max_files" if count > knobs.max_files else "keep_kv.max_disk_gb")
        deletes.append(Delete(f.name, f"least recently used beyond {why}"))
        count, total = count - 1, total - f.size
    return deletes
