"""Non-negative least squares for the few columns of a cost model (`batch_cost.py`'s seven; the
what-if's calibration). Pure numpy, no scipy for one small function: Lawson and Hanson's active
set method (a handful of least-squares solves), with the search over every set of free columns as
its fallback should it not settle. The batch cost refits after every piece: the search took 10 ms
a fit (128 solves), most of a what-if day's time with warm-ups (3,476 fits, 34 of 41 s); the active
set, started from the last fit's columns, usually settles after one solve.
"""

from __future__ import annotations

import itertools

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float64]


def nonnegative_lstsq(a: npt.NDArray[np.float64], y: Vector,
                      support: npt.NDArray[np.bool_] | None = None) -> Vector:
    """argmin |a·x - y| subject to x >= 0. Exact when `a` has full column rank (the prior's rows
    see to that): the optimum is then unique, the least-squares solution on its own support.
    `support`: the columns a similar problem's optimum used (the fit before one more sample), where
    the search starts: usually it holds, and one solve finds the optimum."""
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = a / scale
    x = _active_set(scaled, y, support)
    if x is None:
        x = every_support(scaled, y)
    result: Vector = x / scale
    return result


def _active_set(a: npt.NDArray[np.float64], y: Vector,
                start: npt.NDArray[np.bool_] | None = None) -> Vector | None:
    """Lawson and Hanson (1974, chapter 23), from the free columns `start` when the least-squares
    solution on them is positive (a feasible point the method's steps keep), else from none; None
    if it has not settled within its bound."""
    n = a.shape[1]
    free = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    tol = 10.0 * np.finfo(float).eps * float(np.abs(a).sum(axis=0).max()) * max(a.shape)
    if start is not None and start.shape == (n,) and start.any():
        s = np.zeros(n)
        s[start] = np.linalg.lstsq(a[:, start], y, rcond=None)[0]
        if np.all(s[start] > tol):
            free, x = start.copy(), s
    for _ in range(3 * n):
        gradient = a.T @ (y - a @ x)
        candidates = np.where(~free, gradient, -np.inf)
        j = int(np.argmax(candidates))
        if candidates[j] <= tol:
            return x
        free[j] = True
        for _ in range(3 * n):
            s = np.zeros(n)
            s[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
            if np.all(s[free] > tol):
                x = s
                break
            step = x - s
            shrinking = free & (s <= tol) & (step > 0)
            alpha = float(np.min(x[shrinking] / step[shrinking])) if shrinking.any() else 0.0
            x = x + alpha * (s - x)
            free &= x > tol
            x[~free] = 0.0
        else:
            return None
    return None


def every_support(a: npt.NDArray[np.float64], y: Vector) -> Vector:
    """The unconstrained solution on every set of free columns (the rest held at 0), the best one
    that is non-negative: every candidate is a feasible point, so none beats the optimum. The
    fallback, and the reference the tests hold the active set to (`a`'s columns scaled)."""
    best, best_cost = np.zeros(a.shape[1]), float(np.sum(y * y))
    for free in itertools.product((False, True), repeat=a.shape[1]):
        cols = [j for j, f in enumerate(free) if f]
        if not cols:
            continue
        sol = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        if np.any(sol < 0):
            continue
        x = np.zeros(a.shape[1])
        x[cols] = sol
        cost = float(np.sum((a @ x - y) ** 2))
        if cost < best_cost:
            best, best_cost = x, cost
    return best
