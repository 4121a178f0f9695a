"""The llama-server set-ups `slotwise bench contention --setups` runs side by side, the field report's
scenario at its own scale, and a CPU competitor the benchmark starts and stops itself.

Each set-up is measured against baselines of its own (every phase on a fresh server), so the figures
of one row never borrow from another's.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

from proxy.bench.contention import SERVER_ARGS, Scenario

SETUPS: dict[str, tuple[str, ...]] = {
    "recommended": SERVER_ARGS,
    "np4": ("-np", "4"),
    "np4-noidle": ("-np", "4", "--no-cache-idle-slots"),
    "np4-kvu": ("-np", "4", "-kvu"),
    "np4-kvu-noidle": ("-np", "4", "-kvu", "--no-cache-idle-slots"),
    "auto": ("-np", "-1"),
}
"""Named flag sets: the one docs/prefill.md recommends, and the ones people run (issue #8's table):
four slots with their own KV, the same with one shared KV (the field report's), automatic slots."""

FIELD_ARGS = ("-np", "4", "-kvu", "-c", "98304")
"""The field report's server: four slots, one shared KV, other flags at their defaults."""

FIELD = Scenario(streams=3, chat_turns=True, stream_tokens=300, pause_s=(0.5, 2.0), calm_s=20.0,
                 cold_words=3480, lead_s=4.0, shorts=8, short_every_s=6.0)
"""The field report at its own scale: three users chatting (300-token replies, 0.5-2 s pauses), a
fourth sending short turns now and then, and a returning user whose first turn of the day carries a
~16,000-token history."""

COMPETITOR_LIMIT_S = 1800.0
"""A competitor that outlives its benchmark (a crash) ends by itself after this long."""


@contextlib.contextmanager
def cpu_competitor(limit_s: float = COMPETITOR_LIMIT_S) -> Iterator[None]:
    """Another process busy on the machine for as long as the block runs: one Python loop spinning
    one core (what a compile, a backup or a second service does to a small server)."""
    spin = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end: pass\n"
    process = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        process.kill()
        process.wait()
