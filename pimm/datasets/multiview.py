"""Views for self-supervised pre-training (Sonata), and the transforms
upstream's pre-training configs list next to them.

:class:`MultiViewGenerator` turns one event into ``global_view_num`` large and
``local_view_num`` small crops (each the ``k`` points nearest a centre, ``k``
a random fraction of the event), every crop run through its own transform
pipeline. The crops of one kind are concatenated: ``global_<key>`` /
``local_<key>`` for each of ``view_keys``, with ``global_offset`` /
``local_offset`` the cumulative point count of each crop. The collate
functions turn every ``*offset*`` entry into batch-wide cumulative ends, so a
batch of B events holds ``B * global_view_num`` global views in order
(event 0's views first).

Where the centres come from (upstream's rule): the first global crop is
centred on a random point of the event; the other global crops on random
points of the first one; each local crop on a point of the first global
crop not yet covered by an earlier local crop -- or, for the first
``ceil(local_view_num * anchor_bias_ratio)`` of them when the event carries
``anchors``, on the point of the first global crop nearest a random anchor
(see :class:`MultiViewGenerator`). ``global_shared_transform``
runs once on the event before the global crops are cut (the local crops are
cut from the untransformed event, as upstream does).
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import (MAX_REAL, Choice, DictOf, Int, Key, Keys, Names, NonNeg, Pair, PosInt, Positive,
                                Prob, Real, Registered, Rule, Seq, Transforms)
from pimm.utils.errors import UserError

from .geometry_targets import move_targets, own_targets
from .transform_args import check_args
from .transforms import Compose, _keys, _range, _require

_NO_OWN_TARGETS = own_targets("", None, None, None)

__all__ = ["MultiViewGenerator", "MultiplicativeRandomJitter", "CenterShift"]


#: ``center_height_scale``: a (low, high) window of the event's z extent, as
#: fractions of it; it may reach past [0, 1] (``(0.99, 1.01)``: the top) but
#: must overlap it, or no point could be a centre.
CENTER_HEIGHT_SCALE = Pair(Real(-MAX_REAL))
CENTER_HEIGHT_RULE = Rule(lambda a: a.center_height_scale is None or (
    a.center_height_scale[0] <= 1 and a.center_height_scale[1] >= 0), "center_height_scale",
    "a (low, high) window of the event's z extent, as fractions of it, that overlaps [0, 1]")
#: The anchor kinds upstream's generator pools by default (``led``, faint
#: clusters, is never a centre).
ANCHOR_KEYS = ("endpoints", "branches_track", "branches_shower", "bragg")


def major_centre_candidates(coord: np.ndarray, height: Sequence[float], owner: str) -> np.ndarray:
    """Indices of the points whose z lies in the ``height`` window of the event's z extent."""
    z = coord[:, 2]
    low = z.min() + (z.max() - z.min()) * height[0]
    high = z.min() + (z.max() - z.min()) * height[1]
    candidates = np.flatnonzero((z >= low) & (z <= high))
    if candidates.size == 0:
        raise UserError(f"{owner}: no point of an event ({len(coord)} points, z in [{z.min():.4g}, {z.max():.4g}]) "
                        f"lies in center_height_scale={tuple(height)} of its z extent; widen the window")
    return candidates


@TRANSFORMS.register_module()
class MultiViewGenerator:
    """Global and local crops of one event (see the module doc).

    Args:
        global_view_num / local_view_num: how many crops of each kind.
        global_view_scale / local_view_scale: ``(low, high)``: a crop keeps
            ``uniform(low, high) * min(max_size, N)`` points (at least one).
        global_shared_transform: run once on the whole event before the global crops.
        global_transform / local_transform: run on every global / local crop.
        max_size: at most this many points per crop.
        view_keys: per-point entries carried into the crops (``coord`` required).
        center_height_scale: ``(low, high)`` fractions of the event's z extent
            within which the first crop's centre is drawn.
        shared_global_view: the other global crops are copies of the first.
        anchor_bias_ratio, anchor_radius_scale, anchor_keys: upstream's
            anchor-centred local crops. When the event carries ``anchors`` (a
            dict of (M, 3) point sets, :class:`~pimm.datasets.transforms_anchors.ComputeAnchors`),
            the first ``ceil(local_view_num * anchor_bias_ratio)`` local crops
            are centred on the point of the first global crop nearest a random
            anchor of the kinds in ``anchor_keys`` (``led`` never), and keep
            ``max(8, size * anchor_radius_scale**3)`` points, ``size`` being
            the mean of four draws of a local crop's size; the others are cut
            as without anchors. The four draws are made for every event, as
            upstream makes them, so one seed gives upstream's crops.
        center_sampling, center_sampling_kwargs: only upstream's ``"random"``
            sampling is available (its ``"cnms"`` needs an external package).
    """

    domains = dict(global_view_num=Int(1, 64), local_view_num=Int(0, 256),
                   global_view_scale=Pair(Real(0, 1, lo_open=True)) | None,
                   local_view_scale=Pair(Real(0, 1, lo_open=True)) | None,
                   global_shared_transform=Transforms | Registered("transform"),
                   global_transform=Transforms | Registered("transform"),
                   local_transform=Transforms | Registered("transform"), max_size=PosInt,
                   center_height_scale=CENTER_HEIGHT_SCALE | None, view_keys=Key | Names,
                   center_sampling=Choice("random"), center_sampling_kwargs=DictOf() | None,
                   anchor_bias_ratio=Prob, anchor_radius_scale=Real(0, 1e3), anchor_keys=Key | Keys)
    domain_rules = (Rule(lambda a: "coord" in _keys(a.view_keys), "view_keys", "a list of keys including 'coord'"),
                    CENTER_HEIGHT_RULE)

    def __init__(self, global_view_num: int = 2, global_view_scale: Sequence[float] = (0.4, 1.0),
                 local_view_num: int = 4, local_view_scale: Sequence[float] = (0.1, 0.4),
                 global_shared_transform=None, global_transform=None, local_transform=None, max_size: int = 65536,
                 center_height_scale: Sequence[float] = (0.0, 1.0), shared_global_view: bool = False,
                 view_keys: Sequence[str] = ("coord", "origin_coord", "color", "normal"),
                 center_sampling: str = "random", center_sampling_kwargs: dict | None = None,
                 anchor_bias_ratio: float = 0.6, anchor_radius_scale: float = 1.5,
                 anchor_keys: Sequence[str] | str = ANCHOR_KEYS):
        if center_sampling != "random":
            raise UserError(f"MultiViewGenerator center_sampling={center_sampling!r}: only 'random' is supported")
        if int(global_view_num) < 1 or int(local_view_num) < 0:
            raise UserError(f"MultiViewGenerator: global_view_num={global_view_num} must be >= 1 and "
                            f"local_view_num={local_view_num} >= 0")
        if int(max_size) < 1:
            raise UserError(f"MultiViewGenerator: max_size={max_size} must be >= 1")
        self.view_keys = _keys(view_keys)
        if "coord" not in self.view_keys:
            raise UserError(f"MultiViewGenerator: view_keys={self.view_keys} must include 'coord'")
        check_args(self, center_height_scale=center_height_scale, anchor_bias_ratio=anchor_bias_ratio,
                   anchor_radius_scale=anchor_radius_scale, anchor_keys=anchor_keys)
        self.global_view_num, self.local_view_num = int(global_view_num), int(local_view_num)
        self.global_view_scale = _range(global_view_scale, (0.4, 1.0), "MultiViewGenerator", "global_view_scale")
        self.local_view_scale = _range(local_view_scale, (0.1, 0.4), "MultiViewGenerator", "local_view_scale")
        self.center_height_scale = _range(center_height_scale, (0.0, 1.0), "MultiViewGenerator",
                                          "center_height_scale")
        self.max_size, self.shared_global_view = int(max_size), bool(shared_global_view)
        self.anchor_bias_ratio, self.anchor_radius_scale = float(anchor_bias_ratio), float(anchor_radius_scale)
        self.anchor_keys = tuple(k for k in _keys(anchor_keys) if k != "led")
        self.global_shared_transform = Compose(global_shared_transform)
        self.global_transform = Compose(global_transform)
        self.local_transform = Compose(local_transform)

    def _crop(self, event: dict, center: np.ndarray, scale: tuple[float, float] | None,
              size: int | None = None) -> tuple[dict, np.ndarray]:
        """The ``size`` points nearest ``center`` (drawn from ``scale`` when None)."""
        coord = np.asarray(event["coord"])
        limit = min(self.max_size, len(coord))
        if size is None:
            size = int(np.random.uniform(*scale) * limit)
        size = max(1, min(limit, size))
        index = np.argsort(np.square(coord - center).sum(-1), kind="stable")[:size]
        view = {k: np.asarray(event[k])[index] for k in self.view_keys if k in event}
        if "index_valid_keys" in event:
            view["index_valid_keys"] = list(event["index_valid_keys"])
        return view, index

    def _anchor_pool(self, data: dict) -> np.ndarray:
        anchors = data.get("anchors")
        if not isinstance(anchors, dict):
            return np.zeros((0, 3), np.float32)
        pool = [np.asarray(anchors[k]).reshape(-1, 3) for k in self.anchor_keys
                if anchors.get(k) is not None and len(anchors[k]) > 0]
        return np.concatenate(pool) if pool else np.zeros((0, 3), np.float32)

    def _local_views(self, data: dict, major: dict, major_index: np.ndarray) -> list[dict]:
        anchors = self._anchor_pool(data)
        limit = min(self.max_size, len(data["coord"]))
        base = int(np.mean([np.random.uniform(*self.local_view_scale) * limit for _ in range(4)]))
        anchor_size = int(max(8, min(self.max_size, base * self.anchor_radius_scale ** 3)))
        anchored = int(np.ceil(self.local_view_num * self.anchor_bias_ratio)) if len(anchors) else 0
        locals_ = []
        covered = np.zeros(len(major_index), dtype=bool)
        for i in range(self.local_view_num):
            if covered.all():
                covered[:] = False
            if i < anchored:  # on the point of the first global crop nearest a random anchor
                anchor = anchors[np.random.randint(0, len(anchors))]
                center = major["coord"][np.argmin(np.square(major["coord"] - anchor).sum(-1))]
                view, index = self._crop(data, center, None, size=anchor_size)
            else:
                center = major["coord"][np.random.choice(np.flatnonzero(~covered))]
                view, index = self._crop(data, center, self.local_view_scale)
            locals_.append(view)
            covered[np.isin(major_index, index)] = True
        return locals_

    def __call__(self, data: dict) -> dict:
        coord = np.asarray(_require(data, "coord", "MultiViewGenerator"))
        missing = [k for k in self.view_keys if k not in data]
        if missing:
            raise UserError(f"MultiViewGenerator: the event has no {missing} (view_keys; available: {sorted(data)})")
        if len(coord) == 0:
            raise UserError("MultiViewGenerator: an event has no points; filter empty events (min_points)")
        shared = self.global_shared_transform({k: copy.deepcopy(v) for k, v in data.items()})
        candidates = major_centre_candidates(coord, self.center_height_scale, "MultiViewGenerator")
        major, major_index = self._crop(shared, coord[np.random.choice(candidates)], self.global_view_scale)
        globals_ = [major]
        for _ in range(self.global_view_num - 1):
            if self.shared_global_view:
                globals_.append(copy.deepcopy(major))
            else:
                center = major["coord"][np.random.randint(len(major["coord"]))]
                globals_.append(self._crop(shared, center, self.global_view_scale)[0])
        locals_ = self._local_views(data, major, major_index)
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


@TRANSFORMS.register_module()
class MultiplicativeRandomJitter:
    """With probability ``p``, multiply each entry of ``keys`` (default
    ``energy``) by ``1 + noise``, noise Gaussian of std ``sigma`` clipped to
    +-``clip`` (a charge/energy fluctuation)."""

    domains = dict(sigma=NonNeg, clip=Positive, keys=Key | Keys, p=Prob)

    def __init__(self, sigma: float = 0.05, clip: float = 0.05, keys: Sequence[str] | str = ("energy",),
                 p: float = 0.5):
        if sigma < 0 or clip <= 0:
            raise UserError(f"MultiplicativeRandomJitter needs sigma >= 0 and clip > 0, got {sigma}, {clip}")
        self.sigma, self.clip, self.keys, self.p = float(sigma), float(clip), _keys(keys), float(p)

    def __call__(self, data: dict) -> dict:
        if np.random.rand() >= self.p:
            return data
        out = dict(data)
        for k in self.keys:
            value = np.asarray(_require(data, k, "MultiplicativeRandomJitter"))
            noise = np.clip(self.sigma * np.random.randn(*value.shape), -self.clip, self.clip)
            out[k] = (value * (1.0 + noise)).astype(value.dtype if value.dtype.kind == "f" else np.float32)
        return out


@TRANSFORMS.register_module()
class CenterShift:
    """Shift ``coord`` so that its bounding box is centred on 0 along each of
    ``axes`` (default x, y, z); position targets (``vertex``, the event's
    ``aux_position_keys``) move with it, as upstream's do. ``apply_z`` is
    accepted for upstream's configs and, as there, has no effect: ``axes``
    decides."""

    _AXIS = {"x": 0, "y": 1, "z": 2}

    domains = dict(axes=Choice("x", "y", "z") | Seq(Choice("x", "y", "z")))

    def __init__(self, apply_z: bool = True, axes: Sequence[str] | str = ("x", "y", "z")):
        axes = _keys(axes)
        bad = [a for a in axes if a not in self._AXIS]
        if bad:
            raise UserError(f"CenterShift axes={axes}: use 'x', 'y' and/or 'z'")
        self.axes = tuple(self._AXIS[a] for a in axes)

    def __call__(self, data: dict) -> dict:
        if "coord" not in data or len(data["coord"]) == 0:
            return data
        coord = np.array(data["coord"], copy=True)
        shift = np.zeros(3)
        for a in self.axes:
            shift[a] = (coord[:, a].min() + coord[:, a].max()) / 2
            coord[:, a] -= shift[a]
        out = dict(data)
        out["coord"] = coord
        move_targets(data, out, "CenterShift", _NO_OWN_TARGETS, affine=lambda p: p - shift, linear=None)
        return out
