"""The other view generators upstream pimm registers next to
``MultiViewGenerator`` (:mod:`pimm.datasets.multiview`):

* :class:`ContrastiveViewsGenerator`: two independently augmented copies of
  an event (``view1_<key>``, ``view2_<key>``) for contrastive pre-training.
* :class:`MixedScaleGeometryMultiViewGenerator`: ``MultiViewGenerator``'s
  global and local crops, with ``fine_local_view_num`` of the local crops
  replaced by much smaller ones centred on geometrically complex points
  (where the neighbourhood is far from a straight line) or on random points
  of the first global crop.

Crops are cut exactly as ``MultiViewGenerator`` cuts them (upstream's rule:
the ``uniform(low, high) * min(max_size, N)`` points nearest a centre) and
packed the same way (``global_<key>`` / ``local_<key>`` concatenated, with
``global_offset`` / ``local_offset``). Random draws follow upstream's order
(see :mod:`pimm.datasets.transform_args`).
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import (Choice, DictOf, Int, Key, Keys, Names, Pair, PosInt, Prob, Real, Registered, Rule,
                                Transforms)
from pimm.utils.errors import UserError

from .point_dict import _keys
from .neighbours import knn
from .transform_args import check_args, need
from .multiview import CENTER_HEIGHT_RULE, CENTER_HEIGHT_SCALE, major_centre_candidates
from .transforms import Compose

__all__ = ["ContrastiveViewsGenerator", "MixedScaleGeometryMultiViewGenerator"]


@TRANSFORMS.register_module()
class ContrastiveViewsGenerator:
    """Copy ``view_keys`` of the event twice, run ``view_trans_cfg`` on each
    copy independently (view 1 first), and add every entry of the results as
    ``view1_<key>`` / ``view2_<key>``."""

    domains = dict(view_keys=Key | Names, view_trans_cfg=Transforms | Registered("transform"))

    def __init__(self, view_keys: Sequence[str] = ("coord", "color", "normal", "origin_coord"),
                 view_trans_cfg=None):
        check_args(self, view_keys=view_keys, view_trans_cfg=view_trans_cfg)
        self.view_keys = _keys(view_keys)
        self.view_trans = Compose(view_trans_cfg)

    def __call__(self, data: dict) -> dict:
        missing = [k for k in self.view_keys if k not in data]
        if missing:
            raise UserError(f"ContrastiveViewsGenerator: the event has no {missing} (view_keys; "
                            f"available: {sorted(data)})")
        out = dict(data)
        for name in ("view1", "view2"):
            view = self.view_trans({k: copy.deepcopy(data[k]) for k in self.view_keys})
            out.update({f"{name}_{k}": v for k, v in view.items()})
        return out


def directional_complexity(coord: np.ndarray, k: int) -> np.ndarray:
    """Per point: the middle over the largest eigenvalue of its ``k``
    neighbours' covariance (0 on a line, towards 1 in a blob or a fork)."""
    coord = np.asarray(coord, dtype=np.float32)
    n = coord.shape[0]
    if n < 4:
        return np.zeros(n, dtype=np.float32)
    index = knn(coord, min(int(k) + 1, n))[1][:, 1:]
    if index.shape[1] < 3:
        return np.zeros(n, dtype=np.float32)
    neighbours = coord[index]
    centered = neighbours - neighbours.mean(axis=1, keepdims=True)
    cov = np.einsum("nki,nkj->nij", centered, centered) / centered.shape[1]
    eig = np.maximum(np.linalg.eigvalsh(cov), 0.0)
    return (eig[:, 1] / (eig[:, 2] + 1.0e-8)).astype(np.float32)


_Fraction = Pair(Real(0, 1, lo_open=True))


@TRANSFORMS.register_module()
class MixedScaleGeometryMultiViewGenerator:
    """``MultiViewGenerator`` (same arguments and outputs) whose first
    ``fine_local_view_num`` local crops keep ``fine_local_view_scale`` of the
    points around a centre drawn from the top ``fine_center_top_frac`` of the
    event's points by :func:`directional_complexity` (``fine_center_k``
    neighbours) that lie in the first global crop (``fine_center_mode="geometry"``;
    all of that crop when none does) or from the whole first global crop
    (``"random"``). The remaining local crops are cut as ``MultiViewGenerator``
    cuts them. ``anchor_*`` and ``center_sampling_kwargs`` are accepted for
    upstream's configs and, as there, unused by this generator."""

    domains = dict(fine_local_view_num=Int(0, 256), fine_local_view_scale=_Fraction,
                   fine_center_mode=Choice("geometry", "random"), fine_center_top_frac=Real(0, 1, lo_open=True),
                   fine_center_k=PosInt, global_view_num=Int(1, 64), global_view_scale=_Fraction,
                   local_view_num=Int(0, 256), local_view_scale=_Fraction,
                   global_shared_transform=Transforms | Registered("transform"),
                   global_transform=Transforms | Registered("transform"),
                   local_transform=Transforms | Registered("transform"), max_size=PosInt,
                   center_height_scale=CENTER_HEIGHT_SCALE, view_keys=Key | Names, center_sampling=Choice("random"),
                   center_sampling_kwargs=DictOf() | None, anchor_bias_ratio=Prob,
                   anchor_radius_scale=Real(0, 1e3), anchor_keys=Key | Keys)
    domain_rules = (Rule(lambda a: a.fine_local_view_num <= a.local_view_num, "fine_local_view_num",
                         "at most local_view_num fine crops"),
                    Rule(lambda a: "coord" in _keys(a.view_keys), "view_keys", "a list of keys including 'coord'"),
                    CENTER_HEIGHT_RULE)

    def __init__(self, fine_local_view_num: int = 3, fine_local_view_scale: Sequence[float] = (0.01, 0.04),
                 fine_center_mode: str = "geometry", fine_center_top_frac: float = 0.05, fine_center_k: int = 24,
                 global_view_num: int = 2, global_view_scale: Sequence[float] = (0.4, 1.0), local_view_num: int = 4,
                 local_view_scale: Sequence[float] = (0.1, 0.4), global_shared_transform=None,
                 global_transform=None, local_transform=None, max_size: int = 65536,
                 center_height_scale: Sequence[float] = (0, 1), shared_global_view: bool = False,
                 center_sampling: str = "random", center_sampling_kwargs: dict | None = None,
                 view_keys: Sequence[str] = ("coord", "origin_coord", "color", "normal"),
                 anchor_bias_ratio: float = 0.6, anchor_radius_scale: float = 1.5,
                 anchor_keys: Sequence[str] = ("endpoints", "branches_track", "branches_shower", "bragg")):
        check_args(self, fine_local_view_num=fine_local_view_num, fine_local_view_scale=fine_local_view_scale,
                   fine_center_mode=fine_center_mode, fine_center_top_frac=fine_center_top_frac,
                   fine_center_k=fine_center_k, global_view_num=global_view_num, global_view_scale=global_view_scale,
                   local_view_num=local_view_num, local_view_scale=local_view_scale, max_size=max_size,
                   center_height_scale=center_height_scale, view_keys=view_keys, center_sampling=center_sampling)
        self.fine_num, self.fine_scale = int(fine_local_view_num), tuple(map(float, fine_local_view_scale))
        self.fine_mode, self.top_frac, self.fine_k = fine_center_mode, float(fine_center_top_frac), int(fine_center_k)
        self.global_num, self.global_scale = int(global_view_num), tuple(map(float, global_view_scale))
        self.local_num, self.local_scale = int(local_view_num), tuple(map(float, local_view_scale))
        self.global_shared_transform = Compose(global_shared_transform)
        self.global_transform, self.local_transform = Compose(global_transform), Compose(local_transform)
        self.max_size, self.height = int(max_size), tuple(map(float, center_height_scale))
        self.shared_global_view, self.view_keys = bool(shared_global_view), _keys(view_keys)

    def _crop(self, event: dict, center: np.ndarray, scale: tuple[float, float]) -> tuple[dict, np.ndarray]:
        coord = np.asarray(event["coord"])
        limit = min(self.max_size, coord.shape[0])
        size = max(1, min(limit, int(np.random.uniform(*scale) * limit)))
        index = np.argsort(np.sum(np.square(coord - center), axis=-1))[:size]
        view = {k: np.asarray(event[k])[index] for k in self.view_keys}
        if "index_valid_keys" in event:
            view["index_valid_keys"] = list(event["index_valid_keys"])
        return view, index

    def _fine_pool(self, coord: np.ndarray, major_index: np.ndarray) -> np.ndarray:
        if self.fine_mode == "random":
            return major_index
        score = directional_complexity(coord, self.fine_k)
        count = max(1, int(np.ceil(len(score) * self.top_frac)))
        top = np.argpartition(score, -count)[-count:]
        in_major = np.zeros(len(coord), dtype=bool)
        in_major[major_index] = True
        pool = top[in_major[top]]
        return pool if len(pool) else major_index

    def __call__(self, data: dict) -> dict:
        owner = "MixedScaleGeometryMultiViewGenerator"
        coord = np.asarray(need(data, "coord", owner))
        missing = [k for k in self.view_keys if k not in data]
        if missing:
            raise UserError(f"{owner}: the event has no {missing} (view_keys; available: {sorted(data)})")
        if len(coord) == 0:
            raise UserError(f"{owner}: an event has no points; filter empty events (min_points)")
        shared = self.global_shared_transform(copy.deepcopy(data))
        candidates = major_centre_candidates(coord, self.height, owner)
        major, major_index = self._crop(shared, coord[np.random.choice(candidates)], self.global_scale)
        globals_ = [major]
        for _ in range(self.global_num - 1):
            if self.shared_global_view:
                globals_.append(copy.deepcopy(major))
            else:
                center = major["coord"][np.random.randint(len(major["coord"]))]
                globals_.append(self._crop(shared, center, self.global_scale)[0])
        pool = self._fine_pool(coord, major_index)
        locals_ = [self._crop(data, coord[pool[np.random.randint(len(pool))]], self.fine_scale)[0]
                   for _ in range(self.fine_num)]
        covered = np.zeros(len(major_index), dtype=bool)
        for _ in range(self.local_num - self.fine_num):
            if covered.all():
                covered[:] = False
            view, index = self._crop(data, major["coord"][np.random.choice(np.flatnonzero(~covered))],
                                     self.local_scale)
            locals_.append(view)
            covered[np.isin(major_index, index)] = True
        out = dict(data)
        for kind, views, transform in (("global", globals_, self.global_transform),
                                       ("local", locals_, self.local_transform)):
            if not views:
                continue
            views = [transform(v) for v in views]
            for key in self.view_keys:
                out[f"{kind}_{key}"] = np.concatenate([np.asarray(v[key]) for v in views], axis=0)
            out[f"{kind}_offset"] = np.cumsum([len(v["coord"]) for v in views])
        return out
