"""Event overlay (upstream pimm's ``overlay_n_events`` / ``overlay_prob`` /
``overlay_allow_repeats`` of the PILArNet readers): several events composited
into one point cloud, as pile-up in a real detector.

With probability ``overlay_prob`` an event gets ``n - 1`` other events of the
data set added (``n`` = ``overlay_n_events``, or drawn uniformly from an
inclusive ``(low, high)`` range), chosen uniformly among the distinct events
(before ``loop``), with or without repeats. Each added event is turned about
the detector centre (384, 384, 384) by a random multiple of 90 degrees about
x, then y, then z, its instance ids are shifted past those already present,
and its per-point arrays are appended. Points that land in the same voxel
(rounded coordinates) are merged keeping one, by semantic priority: track >
shower > Michel > delta > low energy (ties: the earlier point). The name gets
``_overlay<n>``.

Randomness: every draw comes from Python's global ``random`` stream, in
upstream's order, which pimm's loader makes resumable -- re-seeded from each
sample's key in a worker process, captured in every checkpoint in the main
process (:mod:`pimm.engines.data`). An overlaid epoch therefore resumes mid-way
bit for bit, with any number of workers.

Differences from upstream (docs/coming-from.md): an added event that fails to
load is an error, not silently skipped; pimm's own ``instance`` and
``interaction`` ids are shifted like upstream's ``instance_*`` ones; every
per-point array of the event is appended (upstream lists its keys by name).
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import numpy as np

from pimm.utils.errors import ConfigError

__all__ = ["EventOverlay", "OverlaidItems", "DETECTOR_CENTER", "LABEL_PRIORITY"]

#: Centre of the 768-voxel PILArNet cube the added events are turned about.
DETECTOR_CENTER = np.array([384.0, 384.0, 384.0], dtype=np.float32)
#: Semantic class -> priority when points share a voxel (lower wins): track, shower, Michel, delta, low energy.
LABEL_PRIORITY = {1: 0, 0: 1, 2: 2, 3: 3, 4: 4}
_INSTANCE_KEYS = ("instance_particle", "instance_interaction", "instance", "interaction")


def _rotation_90(axis: str, turns: int) -> np.ndarray:
    c, s = np.cos(turns * np.pi / 2), np.sin(turns * np.pi / 2)
    if axis == "x":
        m = [[1, 0, 0], [0, c, -s], [0, s, c]]
    elif axis == "y":
        m = [[c, 0, s], [0, 1, 0], [-s, 0, c]]
    else:
        m = [[c, -s, 0], [s, c, 0], [0, 0, 1]]
    return np.array(m, dtype=np.float32)


def rotate_90(coord: np.ndarray, turns: dict[str, int], center: np.ndarray = DETECTOR_CENTER) -> np.ndarray:
    """``coord`` turned about ``center`` by ``turns[axis]`` quarter turns about x, then y, then z."""
    out = coord - center
    for axis in ("x", "y", "z"):
        if turns[axis]:
            out = out @ _rotation_90(axis, turns[axis]).T
    return out + center


def deduplicate_voxels(data: dict, keys: Sequence[str]) -> dict:
    """Keep one point per rounded-coordinate voxel (the highest-priority ``segment_motif``)."""
    voxel = np.round(data["coord"]).astype(np.int64)
    _, group = np.unique(voxel, axis=0, return_inverse=True)
    group = group.reshape(-1)
    order = np.arange(len(group))
    if "segment_motif" in data:
        values, which = np.unique(np.asarray(data["segment_motif"]).reshape(-1), return_inverse=True)
        priority = np.array([LABEL_PRIORITY.get(int(v), 999) for v in values], dtype=np.int64)[which.reshape(-1)]
    else:
        priority = np.zeros(len(group), dtype=np.int64)
    ranked = np.lexsort((order, priority, group))  # by voxel, then priority, then position
    first = np.r_[True, group[ranked][1:] != group[ranked][:-1]] if len(ranked) else np.zeros(0, bool)
    keep = np.sort(ranked[first])
    for key in keys:
        data[key] = data[key][keep]
    return data


class EventOverlay:
    """Upstream's overlay options, checked, and :meth:`__call__` applying them."""

    def __init__(self, n_events: int | Sequence[int] = 1, prob: float = 1.0, allow_repeats: bool = True):
        if isinstance(n_events, (list, tuple)):
            if len(n_events) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in n_events) \
                    or not 1 <= n_events[0] <= n_events[1]:
                raise ConfigError(f"overlay_n_events={list(n_events)!r} must be a count >= 1 or a range "
                                  "(low, high) with 1 <= low <= high")
            self.n_events: int | tuple[int, int] = (int(n_events[0]), int(n_events[1]))
        elif isinstance(n_events, int) and not isinstance(n_events, bool) and n_events >= 1:
            self.n_events = int(n_events)
        else:
            raise ConfigError(f"overlay_n_events={n_events!r} must be a count >= 1 or a range (low, high)")
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0.0 <= prob <= 1.0:
            raise ConfigError(f"overlay_prob={prob!r} must be a probability in [0, 1]")
        self.prob, self.allow_repeats = float(prob), bool(allow_repeats)

    @property
    def enabled(self) -> bool:
        """Whether an event can ever get company (upstream draws nothing otherwise)."""
        return (self.n_events[1] if isinstance(self.n_events, tuple) else self.n_events) > 1

    def __call__(self, data: dict, get_data: Callable[[int], dict], pool: int) -> dict:
        """``data`` with, maybe, other events of ``get_data(0..pool-1)`` overlaid."""
        if not self.enabled or random.random() >= self.prob:
            return data
        n = random.randint(*self.n_events) if isinstance(self.n_events, tuple) else self.n_events
        if n <= 1:
            return data
        if self.allow_repeats:
            indices = [random.randint(0, pool - 1) for _ in range(n - 1)]
        else:
            indices = random.sample(range(pool), min(n - 1, pool))
        points = len(data["coord"])
        keys = [k for k, v in data.items() if isinstance(v, np.ndarray) and v.ndim >= 1 and len(v) == points]
        next_id = {k: int(data[k].max()) + 1 if (data[k] >= 0).any() else 0 for k in _INSTANCE_KEYS if k in keys}
        for index in indices:
            extra = get_data(index)
            for key in next_id:
                ids = extra[key].copy()
                valid = ids >= 0
                ids[valid] += next_id[key]
                extra[key] = ids
                if valid.any():
                    next_id[key] = int(ids[valid].max()) + 1
            turns = {axis: random.randint(0, 3) for axis in ("x", "y", "z")}
            extra["coord"] = rotate_90(extra["coord"], turns).astype(extra["coord"].dtype)
            for key in keys:  # events of one data set have the same keys
                data[key] = np.concatenate([data[key], extra[key]], axis=0)
        data = deduplicate_voxels(data, keys)
        if "name" in data:
            data["name"] = f"{data['name']}_overlay{n}"
        return data


class OverlaidItems:
    """Mixin for a :class:`~pimm.datasets.point_dataset.PointDataset` with an
    ``overlay`` (:class:`EventOverlay`) and an ``index`` of distinct events:
    items are overlaid before the transform; without overlay, the base item."""

    def __getitem__(self, idx: int) -> dict:
        if not self.overlay.enabled:
            return super().__getitem__(idx)
        n = len(self)
        if not -n <= int(idx) < n:
            raise IndexError(f"event index {idx} out of range for a dataset of {n} events")
        # Added events come from the distinct events (before loop), as upstream's.
        data = self.overlay(self.get_data(int(idx) % n), self.get_data, len(self.index))
        return self.transform(data) if self.transform is not None else data
