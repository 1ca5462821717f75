"""Geometric transforms beyond :mod:`pimm.datasets.transforms`, under upstream
pimm's names and arguments: shifts, clipping, wall-aware translation,
quarter-turn rotations, replacement noise, clipped Gaussian jitter and
elastic distortion.

Rigid moves (shifts, rotations) carry the event's geometric targets with
``coord`` -- ``vertex`` and the declared position / direction / vector
targets, by :func:`pimm.datasets.geometry_targets.move_targets`. Random draws
follow upstream's order on the same streams (see
:mod:`pimm.datasets.transform_args`).
"""

from __future__ import annotations

import random
from typing import Sequence

import numpy as np

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import (
    MAX_REAL, Choice, Key, Keys, Length, NonNeg, Pair, Positive, Prob, Real, Rule, Seq,
)
from pimm.utils.errors import UserError

from .geometry_targets import move_targets, own_targets
from .point_dict import _keys
from .transform_args import check_args, float_copy, need, rotation

__all__ = ["PositiveShift", "RandomShift", "PointClip", "ConditionalRandomTransform", "RandomRotateTargetAngle",
           "SetRandomValue", "ClipGaussianJitter", "ElasticDistortion"]

_NO_OWN_TARGETS = own_targets("", None, None, None)
_MAX_NOISE_CELLS = 32_000_000  # ElasticDistortion's grid (3 floats a cell): beyond this the units are wrong
_AXES = ("x", "y", "z")
_Coordinate = Real(-MAX_REAL)


def _translate(data: dict, coord: np.ndarray, shift: np.ndarray, owner: str) -> dict:
    out = dict(data)
    out["coord"] = coord
    move_targets(data, out, owner, _NO_OWN_TARGETS, affine=lambda p: p + shift, linear=None)
    return out


@TRANSFORMS.register_module()
class PositiveShift:
    """Translate ``coord`` so that its bounding box starts at the origin (every
    coordinate >= 0); position targets move with it."""

    def __call__(self, data: dict) -> dict:
        if "coord" not in data or len(data["coord"]) == 0:
            return data
        coord = float_copy(data["coord"])
        low = coord.min(0)
        return _translate(data, coord - low, low.astype(np.float64) * -1, "PositiveShift")


@TRANSFORMS.register_module()
class RandomShift:
    """Translate ``coord`` by ``(uniform(*shift[0]), uniform(*shift[1]), uniform(*shift[2]))``;
    position targets move with it."""

    domains = dict(shift=Seq(Pair(_Coordinate), length=3))

    def __init__(self, shift: Sequence[Sequence[float]] = ((-0.2, 0.2), (-0.2, 0.2), (0, 0))):
        check_args(self, shift=shift)
        self.shift = [tuple(float(v) for v in pair) for pair in shift]

    def __call__(self, data: dict) -> dict:
        if "coord" not in data:
            return data
        shift = np.array([np.random.uniform(low, high) for low, high in self.shift])
        coord = float_copy(data["coord"])
        return _translate(data, (coord + shift).astype(coord.dtype), shift, "RandomShift")


@TRANSFORMS.register_module()
class PointClip:
    """Clamp ``coord`` into the box ``point_cloud_range = (x0, y0, z0, x1, y1, z1)``
    (points are kept, moved onto the box's faces)."""

    domains = dict(point_cloud_range=Seq(_Coordinate, length=6))
    domain_rules = (Rule(lambda a: all(a.point_cloud_range[i] <= a.point_cloud_range[i + 3] for i in range(3)),
                         "point_cloud_range", "(x_min, y_min, z_min, x_max, y_max, z_max) with each min <= max"),)

    def __init__(self, point_cloud_range: Sequence[float] = (-80, -80, -3, 80, 80, 1)):
        check_args(self, point_cloud_range=point_cloud_range)
        self.low = np.asarray(point_cloud_range[:3], dtype=np.float64)
        self.high = np.asarray(point_cloud_range[3:], dtype=np.float64)

    def __call__(self, data: dict) -> dict:
        if "coord" not in data:
            return data
        coord = float_copy(data["coord"])
        out = dict(data)
        out["coord"] = np.clip(coord, self.low, self.high).astype(coord.dtype)
        return out


@TRANSFORMS.register_module()
class ConditionalRandomTransform:
    """Translate an event that touches a wall of ``bounds`` without losing the contact.

    For each of ``axes`` where the event comes within ``buffer_size`` of a
    wall (an event inside on that axis is left alone), with probability ``p``
    shift it along that axis by a uniform draw from the shifts that keep every
    point inside ``bounds`` and keep it within ``buffer_size`` of the wall(s)
    it touched. Meant for coordinates already normalised into ``bounds``.
    Position targets move with the points."""

    domains = dict(p=Prob, axes=Choice(*_AXES) | Seq(Choice(*_AXES)), buffer_size=NonNeg,
                   bounds=Seq(Pair(_Coordinate), length=3))

    def __init__(self, p: float = 0.5, axes: Sequence[str] | str = _AXES, buffer_size: float = 0.05,
                 bounds: Sequence[Sequence[float]] = ((-1, 1), (-1, 1), (-1, 1))):
        check_args(self, p=p, axes=axes, buffer_size=buffer_size, bounds=bounds)
        self.p, self.axes, self.buffer = float(p), set(_keys(axes)), float(buffer_size)
        self.bounds = [tuple(float(v) for v in pair) for pair in bounds]

    def _shift_range(self, low_value: float, high_value: float, dim: int) -> tuple[float, float] | None:
        lower, upper = self.bounds[dim]
        near_lower, near_upper = low_value <= lower + self.buffer, high_value >= upper - self.buffer
        t_low, t_high = lower - low_value, upper - high_value  # every point stays inside
        if near_upper:
            t_low = max(t_low, upper - self.buffer - high_value)  # still touches the upper wall
        if near_lower:
            t_high = min(t_high, lower + self.buffer - low_value)  # still touches the lower wall
        return (t_low, t_high) if t_low <= t_high else None

    def __call__(self, data: dict) -> dict:
        if "coord" not in data or len(data["coord"]) == 0:
            return data
        coord = float_copy(data["coord"])
        shift = np.zeros(3)
        for dim, axis in enumerate(_AXES):
            if axis not in self.axes:
                continue
            low_value, high_value = coord[:, dim].min(), coord[:, dim].max()
            lower, upper = self.bounds[dim]
            if low_value >= lower + self.buffer and high_value <= upper - self.buffer:
                continue  # touches no wall on this axis
            if random.random() > self.p:
                continue
            window = self._shift_range(low_value, high_value, dim)
            if window is not None:
                step = np.random.uniform(*window)
                coord[:, dim] += step
                shift[dim] += step
        if not shift.any():
            return data
        return _translate(data, coord, shift, "ConditionalRandomTransform")


@TRANSFORMS.register_module()
class RandomRotateTargetAngle:
    """With probability ``p`` (1 when ``always_apply``), turn the event about
    ``axis`` by an angle picked from ``angle`` (multiples of pi; default
    quarter, half and three-quarter turns) around ``center`` (``None``: the
    bounding-box centre). ``normal`` and the geometric targets turn with it,
    as in ``RandomRotate`` (whose ``aux_*_keys`` arguments it shares)."""

    domains = dict(angle=Seq(Real(-360, 360), min_len=1), center=Seq(_Coordinate, length=3) | None,
                   axis=Choice(*_AXES), p=Prob,
                   aux_position_keys=Keys | None, aux_direction_keys=Keys | None, aux_vector_keys=Keys | None)

    def __init__(self, angle: Sequence[float] = (1 / 2, 1, 3 / 2), center: Sequence[float] | None = None,
                 axis: str = "z", always_apply: bool = False, p: float = 0.75,
                 aux_position_keys: Sequence[str] | None = None, aux_direction_keys: Sequence[str] | None = None,
                 aux_vector_keys: Sequence[str] | None = None):
        check_args(self, angle=angle, center=center, axis=axis, p=p)
        self.angle = np.asarray(angle, dtype=np.float64)
        self.center = None if center is None else np.asarray(center, dtype=np.float64)
        self.axis, self.p = axis, 1.0 if always_apply else float(p)
        self.targets = own_targets("RandomRotateTargetAngle", aux_position_keys, aux_direction_keys,
                                   aux_vector_keys)

    def __call__(self, data: dict) -> dict:
        if random.random() > self.p:
            return data
        rot = rotation(self.axis, np.random.choice(self.angle) * np.pi)
        coord = np.asarray(need(data, "coord", "RandomRotateTargetAngle"), dtype=np.float64)
        if self.center is not None:
            origin = self.center
        else:
            origin = (coord.min(0) + coord.max(0)) / 2 if len(coord) else np.zeros(3)
        out = dict(data)
        out["coord"] = ((coord - origin) @ rot.T + origin).astype(_float(data["coord"]))
        move_targets(data, out, "RandomRotateTargetAngle", self.targets,
                     affine=lambda q: (q - origin) @ rot.T + origin, linear=lambda d: d @ rot.T)
        if "normal" in data:
            out["normal"] = (np.asarray(data["normal"], dtype=np.float64) @ rot.T).astype(_float(data["normal"]))
        return out


def _float(value) -> np.dtype:
    dtype = np.asarray(value).dtype
    return dtype if dtype.kind == "f" else np.dtype(np.float32)


@TRANSFORMS.register_module()
class SetRandomValue:
    """Replace each of ``keys`` (default ``energy``) by Gaussian noise of std
    ``sigma`` clipped to ``+-clip``, same shape: the feature keeps its shape
    and loses its content (an ablation)."""

    domains = dict(sigma=NonNeg, clip=Positive, keys=Key | Keys)

    def __init__(self, sigma: float = 0.05, clip: float = 0.05, keys: Sequence[str] | str = ("energy",)):
        check_args(self, sigma=sigma, clip=clip, keys=keys)
        self.sigma, self.clip, self.keys = float(sigma), float(clip), _keys(keys)

    def __call__(self, data: dict) -> dict:
        out = dict(data)
        for key in self.keys:
            value = np.asarray(need(data, key, "SetRandomValue"))
            noise = np.clip(np.random.randn(*value.shape) * self.sigma, -self.clip, self.clip)
            out[key] = noise.astype(_float(value))
        return out


@TRANSFORMS.register_module()
class ClipGaussianJitter:
    """Add to ``coord`` per-point noise ``scalar * clip(z / 1.96, -1, 1)``,
    ``z`` standard normal in 3-D (so at most ``scalar`` per axis);
    ``store_jitter`` keeps the noise as the per-point entry ``jitter``."""

    domains = dict(scalar=NonNeg)

    def __init__(self, scalar: float = 0.02, store_jitter: bool = False):
        check_args(self, scalar=scalar)
        self.scalar, self.store_jitter = float(scalar), bool(store_jitter)

    def __call__(self, data: dict) -> dict:
        if "coord" not in data:
            return data
        coord = float_copy(data["coord"])
        z = np.random.multivariate_normal(np.zeros(3), np.identity(3), coord.shape[0])
        jitter = self.scalar * np.clip(z / 1.96, -1, 1)
        out = dict(data)
        out["coord"] = (coord + jitter).astype(coord.dtype)
        if self.store_jitter:
            out["jitter"] = jitter
        return out


def _blur(noise: np.ndarray, axis: int) -> np.ndarray:
    """Mean over each cell and its two neighbours along ``axis`` (zero outside), in float32."""
    padded = np.pad(noise.astype(np.float64), [(1, 1) if a == axis else (0, 0) for a in range(noise.ndim)])
    n = noise.shape[axis]
    total = (padded.take(range(0, n), axis) + padded.take(range(1, n + 1), axis)
             + padded.take(range(2, n + 2), axis))
    return (total / 3.0).astype(np.float32)


def _trilinear(axes: list[np.ndarray], grid: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Linear interpolation of ``grid`` (nx, ny, nz, C) on the regular ``axes`` at ``points``; 0 outside."""
    lower, weight = [], []
    inside = np.ones(len(points), dtype=bool)
    for d, ax in enumerate(axes):
        x = points[:, d]
        inside &= (x >= ax[0]) & (x <= ax[-1])
        i = np.clip(np.searchsorted(ax, x) - 1, 0, len(ax) - 2)
        lower.append(i)
        weight.append((x - ax[i]) / (ax[i + 1] - ax[i]))
    value = np.zeros((len(points), grid.shape[-1]))
    for corner in range(8):
        bits = [(corner >> d) & 1 for d in range(3)]
        w = np.ones(len(points))
        for d in range(3):
            w = w * (weight[d] if bits[d] else 1.0 - weight[d])
        value += w[:, None] * grid[lower[0] + bits[0], lower[1] + bits[1], lower[2] + bits[2]]
    value[~inside] = 0.0
    return value


@TRANSFORMS.register_module()
class ElasticDistortion:
    """Smooth random warp of ``coord`` (in 95% of calls).

    For each ``[granularity, magnitude]`` of ``distortion_params`` (``None``:
    ``[[0.2, 0.4], [0.8, 1.6]]``, in ``coord``'s units), Gaussian noise on a
    grid of spacing ``granularity`` covering the event is blurred (a 3-cell
    box filter, twice per axis) and interpolated at each point, and
    ``magnitude`` times it is added to the point. Only ``coord`` moves: the
    warp is not rigid, so no target is carried with it (as upstream).
    A magnitude of 0 draws the noise but leaves the points where they are,
    and ``[]`` warps nothing, both as upstream; a granularity must be positive."""

    domains = dict(distortion_params=Seq(Seq(NonNeg, length=2)) | None)
    domain_rules = (Rule(lambda a: a.distortion_params is None or all(
        Length.accepts(g) for g, _ in a.distortion_params), "distortion_params",
        "a list of [granularity, magnitude] pairs, granularity > 0 and magnitude >= 0"),)

    def __init__(self, distortion_params: Sequence[Sequence[float]] | None = None):
        check_args(self, distortion_params=distortion_params)
        self.distortion_params = ([[0.2, 0.4], [0.8, 1.6]] if distortion_params is None
                                  else [[float(g), float(m)] for g, m in distortion_params])

    @staticmethod
    def _distort(coord: np.ndarray, granularity: float, magnitude: float) -> np.ndarray:
        low = coord.min(0)
        cells = ((coord - low).max(0) // granularity).astype(int) + 3
        if np.prod(cells.astype(np.float64)) > _MAX_NOISE_CELLS:
            raise UserError(f"ElasticDistortion: granularity {granularity} over an event {np.ptp(coord, 0).max():.4g} "
                            f"wide needs a noise grid of {' x '.join(map(str, cells))} cells; give distortion_params "
                            "in coord's units (e.g. apply it after NormalizeCoord, or raise the granularity)")
        noise = np.random.randn(*cells, 3).astype(np.float32)
        for _ in range(2):
            for axis in range(3):
                noise = _blur(noise, axis)
        axes = [np.linspace(lo, hi, n) for lo, hi, n in zip(low - granularity, low + granularity * (cells - 2), cells)]
        return (coord + _trilinear(axes, noise, coord) * magnitude).astype(coord.dtype)

    def __call__(self, data: dict) -> dict:
        if "coord" not in data or len(data["coord"]) == 0:
            return data
        if random.random() >= 0.95:
            return data
        coord = float_copy(data["coord"])
        for granularity, magnitude in self.distortion_params:
            coord = self._distort(coord, granularity, magnitude)
        out = dict(data)
        out["coord"] = coord
        return out
