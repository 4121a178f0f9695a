"""Non-negative least squares for the few columns of a cost model (`batch_cost.py`'s seven; the
what-if's calibration). Pure numpy, exact for full column rank; no scipy for one small function.
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt


def nonnegative_lstsq(a: npt.NDArray[np.float64], y: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """argmin |a·x - y| subject to x >= 0, for a few columns: the unconstrained solution on every set
    of free columns (the rest held at 0), the best one that is non-negative. Exact when `a` has full
    column rank (the prior's rows see to that): the optimum is the least-squares solution on its own
    support, and every other candidate tried is a feasible point, so none beats it."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = a / scale
    best, best_cost = np.zeros(a.shape[1]), float(np.sum(y * y))
    for free in itertools.product((False, True), repeat=a.shape[1]):
        cols = [j for j, f in enumerate(free) if f]
        if not cols:
            continue
        sol = np.linalg.lstsq(scaled[:, cols], y, rcond=None)[0]
        if np.any(sol < 0):
            continue
        x = np.zeros(a.shape[1])
        x[cols] = sol
        cost = float(np.sum((scaled @ x - y) ** 2))
        if cost < best_cost:
            best, best_cost = x, cost
    result: npt.NDArray[np.float64] = best / scale
    return result
