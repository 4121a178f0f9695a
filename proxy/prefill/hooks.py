"""What the prefill gate (the one scheduler of llama-server's time) asks of the features that share
that time: the keeper of saved KV (keep_kv) and the warm-ups. Protocols, passed to the gate when
the app is built, and the one value a restore answers with. The gate's one loop drives both: it
ticks the warm-up queue, and it runs the keeper's looks at the slots and the saves they find due.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from proxy.estimate import Estimate
from proxy.prefill.events import Load, Restorable, Sizer
from proxy.record.flight import Flight


@dataclass(frozen=True)
class Restored:
    """How a restore the scheduler asked for ended."""

    est: Estimate
    """The request's estimate now (a restored prefix counts as cached)."""
    problem: str | None
    """Why it did not restore (None when done)."""
    done: bool
    """The prefix is in a slot (restored, or the server's cache held it already)."""
    no_slot: bool = False
    """No idle slot was found: worth trying again when the next request finishes."""


class DueSave(Protocol):
    """A save the keeper found due (its own value; the gate only names it)."""

    @property
    def name(self) -> str:
        ...


SaveT = TypeVar("SaveT", bound=DueSave)


class KeepHook(Protocol[SaveT]):
    async def restorable(self, flight: Flight, ids: list[int],
                         est: Estimate) -> tuple[Estimate, Restorable | None]:
        """What a kept file could spare this request, with the estimate corrected."""
        ...

    async def restore(self, flight: Flight, ids: list[int]) -> Restored:
        """Restore its file into an idle slot now; never raises."""
        ...

    def warmed(self, ids: Sequence[int]) -> None:
        """A warm-up's piece left this prefix in a slot: no restore takes that slot from the
        request that continues it."""
        ...

    def next_look_in(self, quiet: bool) -> float | None:
        """Seconds until the keeper wants its next look at the slots (None: no look wanted);
        `quiet`: a save could go now (the policy's rule 16)."""
        ...

    async def look(self, quiet: bool) -> SaveT | None:
        """Read the slots: place ended conversations, run the disk budget; the save now due, if
        `quiet` (it is the store's until `save` or `save_dropped`). Never raises."""
        ...

    async def save(self, save: SaveT) -> None:
        """Run the save (llama-server's main loop writes the file), seal and keep it."""
        ...

    def save_dropped(self, save: SaveT) -> None:
        """The policy did not let it go (the server was no longer quiet): due again later."""
        ...


class WarmHook(Protocol):
    """The warm-ups, driven by the gate's one loop (the policy's rule 15)."""

    async def claim(self, flight: Flight, body: dict[str, Any]) -> int:
        """A real request arrived: its conversation's warm-up ends, its work is credited. Returns
        the largest piece those warm-ups computed (0: none; `Arrived.ramp_from`)."""
        ...

    def tick(self, load: Load, sizer: Sizer) -> float | None:
        """One look at the warm-up queue under `load`; starts the pieces it decides; returns
        when to look again at the latest."""
        ...

    def pieces_in_flight(self) -> int:
        ...

    def done_pieces(self) -> list[tuple[int, int, float]]:
        """(prompt_n, cache_n, batch_ms) of each piece that ended since the last call."""
        ...
