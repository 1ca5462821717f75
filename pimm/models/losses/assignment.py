"""Minimum-cost assignment of a rectangular cost matrix (the Hungarian
problem), in plain numpy: what ``scipy.optimize.linear_sum_assignment``
solves, without the scipy dependency. Used by the query-based instance
losses to pair predicted masks with true instances."""

from __future__ import annotations

import numpy as np

__all__ = ["linear_sum_assignment"]


def _solve_rows_le_cols(cost: np.ndarray) -> np.ndarray:
    """For ``n <= m`` rows/columns: the column of each row, by shortest
    augmenting paths with dual potentials (O(n^2 m))."""
    n, m = cost.shape
    u = np.zeros(n + 1)
    v = np.zeros(m + 1)
    owner = np.zeros(m + 1, dtype=np.int64)  # owner[j]: 1-based row assigned to column j (0: free)
    way = np.zeros(m + 1, dtype=np.int64)
    for i in range(1, n + 1):
        owner[0] = i
        j0 = 0
        minv = np.full(m + 1, np.inf)
        used = np.zeros(m + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = owner[j0]
            free = ~used[1:]
            reduced = cost[i0 - 1] - u[i0] - v[1:]
            better = free & (reduced < minv[1:])
            minv[1:][better] = reduced[better]
            way[1:][better] = j0
            candidates = np.where(free, minv[1:], np.inf)
            j1 = int(np.argmin(candidates)) + 1
            delta = candidates[j1 - 1]
            used_cols = np.nonzero(used)[0]
            u[owner[used_cols]] += delta
            v[used_cols] -= delta
            minv[1:][free] -= delta
            j0 = j1
            if owner[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    row_to_col = np.full(n, -1, dtype=np.int64)
    for j in range(1, m + 1):
        if owner[j]:
            row_to_col[owner[j] - 1] = j - 1
    return row_to_col


def linear_sum_assignment(cost) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, cols)`` of a minimum-cost matching of ``min(n, m)`` pairs,
    ``rows`` increasing (scipy's convention). Non-finite costs are refused."""
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 2:
        raise ValueError(f"the cost matrix must be 2-D, got shape {cost.shape}")
    if cost.size and not np.isfinite(cost).all():
        raise ValueError("the cost matrix holds nan or inf: the predictions that built it are not finite")
    n, m = cost.shape
    if n == 0 or m == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if n <= m:
        cols = _solve_rows_le_cols(cost)
        return np.arange(n, dtype=np.int64), cols
    rows_of_cols = _solve_rows_le_cols(cost.T)
    order = np.argsort(rows_of_cols)
    return rows_of_cols[order].astype(np.int64), order.astype(np.int64)
