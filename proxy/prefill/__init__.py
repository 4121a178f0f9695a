"""Cold-prompt admission: the pure policy, its decision values, piece arithmetic, and the async gate
that applies the decisions (`gate`, its `wake_loop`, with the estimator and the piece feeder).

Everything but `gate`, `wake_loop`, `sharers`, `estimator`, `feeder` and `learned_file` is pure.
"""

from proxy.prefill.events import (
    Admit,
    Arrived,
    CancelPiece,
    Decision,
    FeedPiece,
    Forward,
    Hold,
    Reject,
)
from proxy.prefill.policy import PrefillPolicy
from proxy.prefill.snapshot import ChunkProgress, PolicySnapshot

__all__ = [
    "Admit",
    "Arrived",
    "CancelPiece",
    "ChunkProgress",
    "Decision",
    "FeedPiece",
    "Forward",
    "Hold",
    "PolicySnapshot",
    "PrefillPolicy",
    "Reject",
]
