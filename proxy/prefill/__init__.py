"""Cold-prompt admission: the pure policy, its event and decision values, and piece arithmetic.

The async gate that applies the decisions lives elsewhere; nothing here does I/O.
"""

from proxy.prefill.events import (
    Admit,
    Arrived,
    CancelPiece,
    ClientLeft,
    Decision,
    Event,
    FeedPiece,
    Finished,
    FirstToken,
    Forward,
    Hold,
    PieceDone,
    PieceFailed,
    PrefillStarted,
    Reject,
    Tick,
)
from proxy.prefill.policy import PrefillPolicy
from proxy.prefill.snapshot import ChunkProgress, Phase, PolicySnapshot

__all__ = [
    "Admit",
    "Arrived",
    "CancelPiece",
    "ChunkProgress",
    "ClientLeft",
    "Decision",
    "Event",
    "FeedPiece",
    "Finished",
    "FirstToken",
    "Forward",
    "Hold",
    "Phase",
    "PieceDone",
    "PieceFailed",
    "PolicySnapshot",
    "PrefillPolicy",
    "PrefillStarted",
    "Reject",
    "Tick",
]
