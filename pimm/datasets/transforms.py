"""Per-event point-cloud transforms (augmentation, normalisation, packing).

Each transform is a callable ``data_dict -> data_dict`` registered in
``TRANSFORMS`` so configs list them by name; :class:`Compose` chains a list of
configs. Names, arguments and meanings follow upstream pimm (Pointcept
lineage), so an upstream ``transform=[...]`` list runs unchanged; where pimm
adds an option, upstream's default behaviour is kept. Voxel down-sampling
(:class:`~pimm.datasets.voxelize.GridSample`) and the final packing steps
(:mod:`pimm.datasets.packing`: ``ToTensor``, ``Collect``) live in their own
modules and are re-exported here.

Which entries are per point: the keys listed in ``data["index_valid_keys"]``
when an event carries that list (upstream's mechanism, set with
:class:`Update`), otherwise every numpy array or tensor whose first dimension
equals ``len(data["coord"])`` -- except the ``origin_*`` copies kept for
mapping predictions back to the full-resolution event, and ``inverse`` /
``index`` / ``offset`` bookkeeping. Transforms that drop or reorder points
keep all per-point entries aligned.

Transforms return a new dict and never write into the arrays they were given
(upstream edits in place; results are the same).

Randomness: random transforms draw from the *global* generators and hold
none of their own -- NumPy's here; the ported families
(:mod:`~pimm.datasets.transforms_color`, ``_spatial``, ``_crop``,
``_instance``, ``_anchors``, :mod:`~pimm.datasets.multiview_extra`) also
Python's ``random`` and torch's where upstream draws from them, in upstream's
order. The engine seeds all three per sample in data workers and checkpoints
them in the main process, which is what makes augmentation replay exactly on
resume. Apply geometric transforms before
:class:`~pimm.datasets.packing.ToTensor`.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import numpy as np
import torch

from pimm.engines.registries import TRANSFORMS
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.domains import (
    Choice, DictOf, Key, Keys, MAX_REAL, NonNeg, Pair, Positive, Prob, Real, Registered, Seq, Transforms,
)

from .packing import Collect, ToTensor  # noqa: F401  (registered there; re-exported)
from .point_dict import _keys, _num_points, _require, index_points, point_keys
from .voxelize import GridSample  # noqa: F401  (registered next to the other transforms; re-exported)

from .geometry_targets import move_targets, own_targets
from .transforms_energy import LogTransform  # noqa: F401  (moved there with the other energy maps; re-exported)

__all__ = [
    "Compose", "Copy", "Update", "NormalizeCoord", "RandomRotate", "RandomFlip", "RandomJitter",
    "RandomScale", "ShufflePoint", "LogTransform", "ToTensor", "Collect", "index_points", "point_keys",
]

_AXES = {"x": 0, "y": 1, "z": 2, 0: 0, 1: 1, 2: 2}


def _axis(axis: Any) -> int:
    if axis not in _AXES:
        raise UserError(f"axis {axis!r} is not one of 'x', 'y', 'z' (or 0, 1, 2)")
    return _AXES[axis]


def _range(value: Any, default: tuple, owner: str, name: str) -> tuple[float, float]:
    low, high = default if value is None else value
    if low > high:
        raise UserError(f"{owner}: {name}={value!r} must be a (low, high) range with low <= high")
    return float(low), float(high)


@TRANSFORMS.register_module()
class Compose:
    """Apply transforms in order. Items are ``dict(type=...)`` configs (built
    from ``TRANSFORMS``) or callables; ``None``/empty means identity."""

    domains = dict(transforms=Transforms | Registered("transform"))

    def __init__(self, transforms: Sequence[dict | Callable] | dict | None = None):
        if isinstance(transforms, dict) or callable(transforms):
            transforms = [transforms]  # a single transform given without a list
        self.transforms = [t if callable(t) else TRANSFORMS.build(t) for t in (transforms or [])]

    def __call__(self, data: dict) -> dict:
        for t in self.transforms:
            data = t(data)
        return data

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


@TRANSFORMS.register_module()
class Copy:
    """Copy entries to new names: ``keys_dict={source: destination}``.

    The default keeps ``coord`` and ``segment`` as ``origin_coord`` /
    ``origin_segment`` (untouched by later sampling, for evaluating at full
    resolution); ``keys_dict={"segment_motif": "segment"}`` picks the PILArNet
    label to train on. Destinations are independent copies."""

    domains = dict(keys_dict=DictOf(Key, Key) | None)

    def __init__(self, keys_dict: dict | None = None):
        self.keys_dict = dict(coord="origin_coord", segment="origin_segment") if keys_dict is None else dict(keys_dict)

    def __call__(self, data: dict) -> dict:
        out = dict(data)
        for source, destination in self.keys_dict.items():
            value = _require(data, source, "Copy")
            if isinstance(value, np.ndarray):
                out[destination] = value.copy()
            elif isinstance(value, torch.Tensor):
                out[destination] = value.clone().detach()
            else:
                out[destination] = copy.deepcopy(value)
        return out


def _finite_if_number(key: str, value: Any) -> Any:
    """any value, a number only a finite one (a grid size of nan would reach the model)"""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not Real(-MAX_REAL).accepts(value):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a finite number")
    return value


@TRANSFORMS.register_module()
class Update:
    """Set entries to fixed values: ``keys_dict={key: value}``. Mostly used to
    set ``index_valid_keys``, the list of per-point entries later transforms
    keep aligned (see the module doc)."""

    domains = dict(keys_dict=DictOf(Key, _finite_if_number) | None)

    def __init__(self, keys_dict: dict | None = None):
        self.keys_dict = dict(keys_dict or {})

    def __call__(self, data: dict) -> dict:
        out = dict(data)
        out.update(copy.deepcopy(self.keys_dict))
        return out


@TRANSFORMS.register_module()
class NormalizeCoord:
    """``coord = (coord - center) / scale``.

    ``center``: ``None`` or ``"mean"`` (the centroid, upstream's default),
    ``"box"`` (bounding-box centre) or a fixed 3-vector. ``scale``: ``None``
    divides by the event's own extent -- the largest distance from the centre
    (``mode="sphere"``, upstream's only mode: result inside the unit ball) or
    the largest half-side of the bounding box (``mode="box"``: inside
    [-1, 1]^3); a number divides by that value, which keeps sizes comparable
    across events (PILArNet: ``center=[384]*3``, ``scale=768*sqrt(3)/2``).

    Position targets (``vertex`` and ``aux_position_keys``) get the same
    ``(p - center) / scale``; directions and vectors keep theirs (see
    :mod:`pimm.datasets.geometry_targets`)."""

    domains = dict(center=Choice("mean", "box") | Seq(Real(-MAX_REAL), length=3) | None, scale=Positive | None,
                   mode=Choice("sphere", "box"),
                   aux_position_keys=Keys | None, aux_direction_keys=Keys | None, aux_vector_keys=Keys | None)

    def __init__(self, center: str | Sequence[float] | None = None, scale: float | None = None,
                 mode: str = "sphere", aux_position_keys: Sequence[str] | None = None,
                 aux_direction_keys: Sequence[str] | None = None, aux_vector_keys: Sequence[str] | None = None):
        self.targets = own_targets("NormalizeCoord", aux_position_keys, aux_direction_keys, aux_vector_keys)
        if mode not in ("sphere", "box"):
            raise UserError(f"NormalizeCoord mode={mode!r}: use 'sphere' or 'box'")
        if isinstance(center, str) and center not in ("mean", "box"):
            raise UserError(f"NormalizeCoord center={center!r}: use None, 'mean', 'box' or a 3-vector")
        if scale is not None and (isinstance(scale, bool) or not scale > 0):
            raise UserError(f"NormalizeCoord scale={scale!r} must be a positive number or None")
        self.center, self.scale, self.mode = center, scale, mode

    def __call__(self, data: dict) -> dict:
        coord = np.asarray(_require(data, "coord", "NormalizeCoord"), dtype=np.float64)
        if len(coord) == 0:
            return data
        if self.center is None or self.center == "mean":
            c = coord.mean(0)
        elif isinstance(self.center, str):
            c = (coord.min(0) + coord.max(0)) / 2
        else:
            c = np.asarray(self.center, dtype=np.float64)
        coord = coord - c
        if self.scale is not None:
            s = self.scale
        elif self.mode == "sphere":
            s = np.sqrt((coord**2).sum(1)).max()
        else:
            s = np.abs(coord).max()
        s = s if s > 0 else 1.0
        out = dict(data)
        out["coord"] = (coord / s).astype(np.float32)
        move_targets(data, out, "NormalizeCoord", self.targets, affine=lambda p: (p - c) / s, linear=None)
        return out


@TRANSFORMS.register_module()
class RandomRotate:
    """With probability ``p`` (1 when ``always_apply``), rotate ``coord`` (and
    ``normal``) about ``axis`` by an angle drawn uniformly from ``angle``, in
    multiples of pi (``None``: ``[-1, 1]``, any angle), around ``center``
    (``None``: the bounding-box centre; else a fixed point).

    The turn is right-handed about every axis (a positive angle about ``y``
    takes ``z`` towards ``x``), as upstream. Position targets (``vertex``,
    ``aux_position_keys``) turn about the same centre; directions and
    vectors (``aux_direction_keys``, ``aux_vector_keys``) turn about the
    origin, directions renormalised (see :mod:`pimm.datasets.geometry_targets`)."""

    domains = dict(angle=Pair(Real(-360, 360)) | None, center=Seq(Real(-MAX_REAL), length=3) | None,
                   axis=Choice("x", "y", "z"), p=Prob,
                   aux_position_keys=Keys | None, aux_direction_keys=Keys | None, aux_vector_keys=Keys | None)

    def __init__(self, angle: Sequence[float] | None = None, center: Sequence[float] | None = None,
                 axis: str = "z", always_apply: bool = False, p: float = 0.5,
                 aux_position_keys: Sequence[str] | None = None, aux_direction_keys: Sequence[str] | None = None,
                 aux_vector_keys: Sequence[str] | None = None):
        self.targets = own_targets("RandomRotate", aux_position_keys, aux_direction_keys, aux_vector_keys)
        if isinstance(center, bool):
            raise UserError(f"RandomRotate center={center!r}: give None (bounding-box centre) or a 3-vector")
        self.angle = _range(angle, (-1.0, 1.0), "RandomRotate", "angle")
        self.center = None if center is None else np.asarray(center, dtype=np.float64)
        self.axis, self.always_apply = _axis(axis), bool(always_apply)
        self.p = 1.0 if always_apply else float(p)

    def __call__(self, data: dict) -> dict:
        if np.random.rand() >= self.p:
            return data
        theta = np.random.uniform(*self.angle) * np.pi
        c, s = np.cos(theta), np.sin(theta)
        # (i, j) in cyclic order after the axis -- x: (y, z), y: (z, x), z: (x, y) -- so that
        # i turns towards j for a positive angle about every axis.
        i, j = (self.axis + 1) % 3, (self.axis + 2) % 3
        rot = np.eye(3)
        rot[i, i], rot[i, j], rot[j, i], rot[j, j] = c, -s, s, c
        coord = np.asarray(_require(data, "coord", "RandomRotate"), dtype=np.float64)
        if self.center is not None:
            origin = self.center
        else:
            origin = (coord.min(0) + coord.max(0)) / 2 if len(coord) else np.zeros(3)
        out = dict(data)
        out["coord"] = ((coord - origin) @ rot.T + origin).astype(np.float32)
        move_targets(data, out, "RandomRotate", self.targets,
                     affine=lambda q: (q - origin) @ rot.T + origin, linear=lambda d: d @ rot.T)
        if "normal" in data:
            out["normal"] = (np.asarray(data["normal"], dtype=np.float64) @ rot.T).astype(np.float32)
        return out


@TRANSFORMS.register_module()
class RandomFlip:
    """Mirror through the origin plane: for each of ``axes`` independently,
    with probability ``p``, negate that column of ``coord`` (and ``normal``).
    Position, direction and vector targets (``vertex``, ``aux_*_keys``; see
    :mod:`pimm.datasets.geometry_targets`) are mirrored the same way."""

    domains = dict(p=Prob, axes=Choice("x", "y", "z") | Seq(Choice("x", "y", "z")),
                   aux_position_keys=Keys | None, aux_direction_keys=Keys | None, aux_vector_keys=Keys | None)

    def __init__(self, p: float = 0.5, axes: Sequence[str] | str = ("x", "y"),
                 aux_position_keys: Sequence[str] | None = None, aux_direction_keys: Sequence[str] | None = None,
                 aux_vector_keys: Sequence[str] | None = None):
        self.p, self.axes = float(p), [_axis(a) for a in _keys(axes)]
        self.targets = own_targets("RandomFlip", aux_position_keys, aux_direction_keys, aux_vector_keys)

    def __call__(self, data: dict) -> dict:
        _require(data, "coord", "RandomFlip")
        out = dict(data)
        targets = [k for k in ("coord", "normal") if k in data]
        for k in targets:
            out[k] = np.array(data[k], dtype=np.float32)
        signs = np.ones(3)
        for a in self.axes:
            if np.random.rand() < self.p:
                signs[a] = -signs[a]
                for k in targets:
                    out[k][:, a] = -out[k][:, a]
        if (signs < 0).any():
            mirror = lambda v: v * signs  # noqa: E731  (a flip is its own linear and affine part)
            move_targets(data, out, "RandomFlip", self.targets, affine=mirror, linear=mirror)
        return out


@TRANSFORMS.register_module()
class RandomJitter:
    """With probability ``p``, add Gaussian noise of std ``sigma``, clipped to
    +-``clip``, to each entry of ``keys`` (default ``coord``)."""

    domains = dict(sigma=NonNeg, clip=Positive, keys=Key | Keys, p=Prob)

    def __init__(self, sigma: float = 0.01, clip: float = 0.05, keys: Sequence[str] | str = ("coord",),
                 p: float = 1.0):
        if sigma < 0 or clip <= 0:
            raise UserError(f"RandomJitter needs sigma >= 0 and clip > 0, got {sigma}, {clip}")
        self.sigma, self.clip, self.keys, self.p = sigma, clip, _keys(keys), float(p)

    def __call__(self, data: dict) -> dict:
        if np.random.rand() >= self.p:
            return data
        out = dict(data)
        for k in self.keys:
            value = np.asarray(_require(data, k, "RandomJitter"))
            noise = np.clip(self.sigma * np.random.randn(*value.shape), -self.clip, self.clip)
            out[k] = (value + noise).astype(value.dtype if value.dtype.kind == "f" else np.float32)
        return out


@TRANSFORMS.register_module()
class RandomScale:
    """Multiply ``coord`` by a factor drawn uniformly from ``scale`` (``None``:
    ``[0.95, 1.05]``), one per axis when ``anisotropic``, about the origin.
    Position targets (``vertex``, ``aux_position_keys``) are scaled too;
    directions and vectors are not, as upstream (even an anisotropic factor
    leaves them: see :mod:`pimm.datasets.geometry_targets`)."""

    domains = dict(scale=Pair(Positive) | None,
                   aux_position_keys=Keys | None, aux_direction_keys=Keys | None, aux_vector_keys=Keys | None)

    def __init__(self, scale: Sequence[float] | None = None, anisotropic: bool = False,
                 aux_position_keys: Sequence[str] | None = None, aux_direction_keys: Sequence[str] | None = None,
                 aux_vector_keys: Sequence[str] | None = None):
        self.scale, self.anisotropic = _range(scale, (0.95, 1.05), "RandomScale", "scale"), anisotropic
        self.targets = own_targets("RandomScale", aux_position_keys, aux_direction_keys, aux_vector_keys)

    def __call__(self, data: dict) -> dict:
        factor = np.random.uniform(*self.scale, size=3 if self.anisotropic else 1)
        out = dict(data)
        out["coord"] = (np.asarray(_require(data, "coord", "RandomScale")) * factor).astype(np.float32)
        move_targets(data, out, "RandomScale", self.targets, affine=lambda p: p * factor, linear=None)
        return out


@TRANSFORMS.register_module()
class ShufflePoint:
    """Randomly permute the points (all per-point entries together)."""

    def __call__(self, data: dict) -> dict:
        return index_points(data, np.random.permutation(_num_points(data)))


__all__ += ["GridSample"]
