"""Crops and drops, under upstream pimm's names and arguments.

Transforms that remove or reorder points index every per-point entry of the
event together (:func:`pimm.datasets.point_dict.index_points`: the keys in
``index_valid_keys`` when the event lists them, else every array as long as
``coord``), so labels, instances, vertices, energies and any auxiliary
per-point key stay aligned with ``coord``. Random draws follow upstream's
order on the same streams (see :mod:`pimm.datasets.transform_args`).
"""

from __future__ import annotations

import random
from typing import Sequence

import numpy as np

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import Choice, Int, Key, PosInt, Prob, Real, Seq
from pimm.utils.errors import UserError

from .point_dict import index_points
from .transform_args import check_args, need

__all__ = ["SphereCrop", "HardExampleCrop", "CropBoundary", "RandomDropout", "RandomDrop"]


def _budget(n: int, point_max: int, sample_rate: float | None) -> int:
    return int(sample_rate * n) if sample_rate is not None else point_max


def _nearest(coord: np.ndarray, center: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` points nearest ``center``, nearest first."""
    return np.argsort(np.sum(np.square(coord - center), axis=1))[:count]


@TRANSFORMS.register_module()
class SphereCrop:
    """Keep at most ``point_max`` points (``sample_rate``: that fraction of the
    event instead): when the event has more, the ones nearest a centre -- a
    random point (``mode="random"``) or the point at the middle index
    (``"center"``). Smaller events pass unchanged. Upstream's ``mode="all"``
    never crops (it raises once an event is over budget) and is refused here."""

    domains = dict(point_max=PosInt, sample_rate=Real(0, 1, lo_open=True) | None, mode=Choice("random", "center"))

    def __init__(self, point_max: int = 80000, sample_rate: float | None = None, mode: str = "random"):
        if mode == "all":
            raise UserError("SphereCrop mode='all' is not implemented upstream either (it fails on the first event "
                            "over budget); use 'random' or 'center'")
        check_args(self, point_max=point_max, sample_rate=sample_rate, mode=mode)
        self.point_max, self.sample_rate, self.mode = int(point_max), sample_rate, mode

    def __call__(self, data: dict) -> dict:
        coord = np.asarray(need(data, "coord", "SphereCrop"))
        n = coord.shape[0]
        budget = _budget(n, self.point_max, self.sample_rate)
        if n <= budget:
            return data
        center = coord[np.random.randint(n)] if self.mode == "random" else coord[n // 2]
        return index_points(data, _nearest(coord, center, budget))


@TRANSFORMS.register_module()
class HardExampleCrop:
    """With probability ``p``, a sphere crop to ``point_max`` points (or the
    ``sample_rate`` fraction) centred on a *hard* point: one whose ``segment``
    is in ``hard_labels``. Up to ``attempts`` centres are tried until the crop
    holds at least ``min_hard_points`` hard points (else the last try is kept).
    An event without hard points (or without ``segment``) is cropped around a
    random point (``fallback="random"``), the middle-index point
    (``"center"``) or left whole (``"none"``)."""

    domains = dict(point_max=PosInt, sample_rate=Real(0, 1, lo_open=True) | None, hard_labels=Seq(Int(-10**9)),
                   min_hard_points=Int(0), attempts=Int(0, 10**6), fallback=Choice("random", "center", "none"),
                   p=Prob)

    def __init__(self, point_max: int = 80000, sample_rate: float | None = None, hard_labels: Sequence[int] = (2, 3),
                 min_hard_points: int = 1, attempts: int = 5, fallback: str = "none", p: float = 0.5):
        check_args(self, point_max=point_max, sample_rate=sample_rate, hard_labels=hard_labels,
                   min_hard_points=min_hard_points, attempts=attempts, fallback=fallback, p=p)
        self.point_max, self.sample_rate, self.hard_labels = int(point_max), sample_rate, tuple(hard_labels)
        self.min_hard_points, self.attempts = int(min_hard_points), max(1, int(attempts))
        self.fallback, self.p = fallback, float(p)

    def __call__(self, data: dict) -> dict:
        coord = np.asarray(need(data, "coord", "HardExampleCrop"))
        if np.random.rand() >= self.p:
            return data
        n = coord.shape[0]
        budget = _budget(n, self.point_max, self.sample_rate)
        if n <= budget:
            return data
        if data.get("segment") is not None:
            hard = np.isin(np.asarray(data["segment"]).reshape(-1), self.hard_labels)
        else:
            hard = np.zeros(n, dtype=bool)
        if hard.any():
            candidates = np.flatnonzero(hard)
            for _ in range(self.attempts):
                crop = _nearest(coord, coord[np.random.choice(candidates)], budget)
                if np.count_nonzero(hard[crop]) >= self.min_hard_points:
                    break
            return index_points(data, crop)
        if self.fallback == "none":
            return data
        center = coord[n // 2] if self.fallback == "center" else coord[np.random.randint(n)]
        return index_points(data, _nearest(coord, center, budget))


@TRANSFORMS.register_module()
class CropBoundary:
    """Drop the points whose ``segment`` is 0 or 1 (upstream's fixed pair of
    unannotated / boundary classes)."""

    def __call__(self, data: dict) -> dict:
        segment = np.asarray(need(data, "segment", "CropBoundary")).reshape(-1)
        return index_points(data, np.flatnonzero((segment != 0) & (segment != 1)))


@TRANSFORMS.register_module()
class RandomDropout:
    """With probability ``dropout_application_ratio``, keep a random
    ``1 - dropout_ratio`` of the points (at least the listed ``sampled_index``
    points when the event has that entry, which is renumbered to the kept points)."""

    domains = dict(dropout_ratio=Real(0, 1, hi_open=True), dropout_application_ratio=Prob)

    def __init__(self, dropout_ratio: float = 0.2, dropout_application_ratio: float = 0.5):
        check_args(self, dropout_ratio=dropout_ratio, dropout_application_ratio=dropout_application_ratio)
        self.dropout_ratio, self.application = float(dropout_ratio), float(dropout_application_ratio)

    def __call__(self, data: dict) -> dict:
        if random.random() >= self.application:
            return data
        n = len(need(data, "coord", "RandomDropout"))
        keep = np.random.choice(n, int(n * (1 - self.dropout_ratio)), replace=False)
        sampled = data.get("sampled_index")
        if sampled is None:
            return index_points(data, keep)
        sampled = np.asarray(sampled)
        keep = np.unique(np.append(keep, sampled))
        labelled = np.zeros(n, dtype=bool)
        labelled[sampled] = True
        out = index_points({k: v for k, v in data.items() if k != "sampled_index"}, keep)
        out["sampled_index"] = np.flatnonzero(labelled[keep])
        return out


@TRANSFORMS.register_module()
class RandomDrop:
    """With probability ``p_apply``, set a random ``p_drop`` fraction of the
    rows of ``key`` to ``value`` (feature masking: no point is removed). An
    event without ``key`` passes unchanged."""

    domains = dict(key=Key, p_apply=Prob, p_drop=Prob, value=Real(-1e9))

    def __init__(self, key: str, p_apply: float = 0.5, p_drop: float = 0.2, value: float = 0.0):
        check_args(self, key=key, p_apply=p_apply, p_drop=p_drop, value=value)
        self.key, self.p_apply, self.p_drop, self.value = key, float(p_apply), float(p_drop), float(value)

    def __call__(self, data: dict) -> dict:
        if self.key not in data or np.random.rand() >= self.p_apply:
            return data
        values = np.array(data[self.key], copy=True)
        n = values.shape[0]
        values[np.random.choice(n, int(n * self.p_drop), replace=False)] = self.value
        out = dict(data)
        out[self.key] = values
        return out
