"""Piece arithmetic for feeding a cold prompt in pieces, and the learned prefill rate.

Pure functions plus one small estimator; the policy owns the only instance.
"""

from __future__ import annotations

PIECE_ALIGN = 64
"""Piece ends are multiples of this many tokens (also the cache model's block size)."""

DEFAULT_PREFILL_TPS = 500.0
"""A conservative first guess of the server's prefill rate (tokens/s), replaced by measurements."""


class PrefillRate:
    """The server's prefill rate in tokens/s: an exponentially weighted mean of what was measured.

    The first measurement replaces the default outright; later ones move the mean by `alpha`.
    Measurements of fewer than `min_tokens` tokens are ignored (overhead dominates them);
    pieces pass
    `min_tokens=1` because their size is chosen by the policy itself.
    """

    def __init__(self, initial_tps: float = DEFAULT_PREFILL_TPS, *, alpha: float = 0.3) -> None:
        if initial_tps <= 0 or not 0 < alpha <= 1:
            raise ValueError(f"need initial_tps > 0 and 0 < alpha <= 1, got {initial_tps}, {alpha}")
        self._tps = initial_tps
        self._alpha = alpha
        self._samples = 0

    @property
    def tps(self) -> float:
        return self._tps

    @property
    def samples(self) -> int:
        return self._samples

    def observe(self, tokens: int, elapsed_ms: float, *, min_tokens: int = 1) -> None:
        if tokens < max(1, min_tokens) or elapsed_ms <= 0:
            return
        measured = tokens * 1000.0 / elapsed_ms
        self._tps = measured if self._samples == 0 else (
            self._alpha * measured + (1 - self._alpha) * self._tps)
        self._samples += 1


def piece_tokens(prefill_tps: float, max_stall_ms: float, n_batch: int,
                 align: int = PIECE_ALIGN) -> int:
    """Tokens per piece so that the decode steps carrying it stall others at most `max_stall_ms`.

    A step with P prompt tokens takes about P / rate; the server cuts P into `n_batch` steps anyway,
    so P never exceeds `n_batch`. Rounded down to `align`, and at least `align`.
    """
    wanted = min(float(n_batch), prefill_tps * max_stall_ms / 1000.0)
    return max(align, int(wanted) // align * align)


def pause_s(piece_elapsed_s: float, prefill_share: float) -> float:
    """The pause after a piece that gives the prompt `prefill_share` of the time."""
    return max(0.0, piece_elapsed_s) * (1.0 - prefill_share) / prefill_share


def next_upto(done: int, piece: int, align: int = PIECE_ALIGN) -> int:
    """End of the next cumulative prefix: `done + piece` rounded down to `align` (always > done)."""
    return max(done + 1, (done + piece) // align * align)
