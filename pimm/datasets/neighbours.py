"""Exact k-nearest neighbours of a point cloud, without SciPy.

Small clouds are searched by brute force. Larger ones are bucketed into a
grid of cubic cells of side ``h`` (the 90th percentile of the ``k``-th
neighbour distance of a spread of sample points): each point's candidates
are the points of its own and the 26 surrounding cells. Any point outside
that block is at least ``h`` away, so a point whose ``k``-th candidate lies
closer than ``h`` has its exact neighbours; the few others (isolated
points) are searched by brute force. Nothing here draws random numbers.
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["knn"]

_BRUTE_FORCE_BELOW = 4096
_PAIRS_PER_CHUNK = 1 << 20  # distances held at once (a few tens of MiB with the differences)
_OFFSETS = np.array(list(itertools.product((-1, 0, 1), repeat=3)))


def _nearest(queries: np.ndarray, points: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact distances ``sqrt(sum((q - p)**2))`` and the ``k`` smallest per query, nearest first."""
    d = np.sqrt(np.square(queries[:, None, :] - points[None, :, :]).sum(-1))
    if k < d.shape[1]:
        index = np.argpartition(d, k - 1, axis=1)[:, :k]
    else:
        index = np.broadcast_to(np.arange(d.shape[1]), d.shape)
    d = np.take_along_axis(d, index, axis=1)
    order = np.argsort(d, axis=1, kind="stable")
    return np.take_along_axis(d, order, axis=1), np.take_along_axis(index, order, axis=1)


def _brute(queries: np.ndarray, points: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    chunk = max(1, _PAIRS_PER_CHUNK // max(1, len(points)))
    parts = [_nearest(queries[s:s + chunk], points, k) for s in range(0, len(queries), chunk)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def knn(coord, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Distances (float64) and indices of each point's ``k`` nearest points,
    itself included (nearest first); ``k`` at most the number of points."""
    points = np.asarray(coord, dtype=np.float64).reshape(-1, 3)
    n = len(points)
    if n < _BRUTE_FORCE_BELOW:
        return _brute(points, points, k)
    sample = points[np.linspace(0, n - 1, 256).astype(np.int64)]
    side = max(float(np.quantile(_brute(sample, points, k)[0][:, -1], 0.9)), 1e-9)
    cells = np.floor((points - points.min(0)) / side).astype(np.int64)
    span = cells.max(0) + 3
    keys = ((cells[:, 0] + 1) * span[1] + cells[:, 1] + 1) * span[2] + cells[:, 2] + 1
    order = np.argsort(keys, kind="stable")
    occupied, starts, counts = np.unique(keys[order], return_index=True, return_counts=True)
    where = dict(zip(occupied.tolist(), zip(starts.tolist(), counts.tolist())))
    steps = ((_OFFSETS[:, 0] * span[1] + _OFFSETS[:, 1]) * span[2] + _OFFSETS[:, 2]).tolist()
    dist = np.full((n, k), np.inf)
    index = np.zeros((n, k), dtype=np.int64)
    for key, start, count in zip(occupied.tolist(), starts.tolist(), counts.tolist()):
        members = order[start:start + count]
        candidates = np.concatenate([order[b:b + c] for b, c in (where[key + s] for s in steps if key + s in where)])
        if len(candidates) < k:
            continue  # left to the brute-force pass
        value, idx = _nearest(points[members], points[candidates], k)
        dist[members], index[members] = value, candidates[idx]
    unsure = np.flatnonzero(~(dist[:, -1] < side))
    if len(unsure):
        dist[unsure], index[unsure] = _brute(points[unsure], points, k)
    return dist, index
