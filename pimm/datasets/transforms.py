"""Per-event point-cloud transforms (augmentation, voxel sampling, packing).

Each transform is a callable ``data_dict -> data_dict`` registered in
``TRANSFORMS`` so configs can list them by name; :class:`Compose` chains a list
of configs. Events are dicts whose *per-point* entries are arrays with one row
per point (``coord``, ``energy``, ``segment``, ``instance``, ``interaction``,
``grid_coord``, ...): any numpy array or tensor whose first dimension equals
``len(data["coord"])`` is treated as per-point, so transforms that drop or
reorder points keep every such key aligned. Keep per-event arrays of that
length out of the dict (or add them after sampling).

Randomness: random transforms draw from the *global* numpy RNG
(``np.random.*``) and hold no RNG of their own. The engine seeds that RNG per
sample in data workers and checkpoints it in the main process, which is what
makes augmentation replay exactly on resume. Apply random/geometric transforms
before :class:`ToTensor` (they expect numpy arrays).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from pimm.engines.registries import TRANSFORMS
from pimm.utils.errors import UserError

__all__ = [
    "Compose", "NormalizeCoord", "GridSample", "RandomRotate", "RandomFlip", "RandomJitter",
    "RandomScale", "ShufflePoint", "LogTransform", "ToTensor", "Collect", "index_points",
]

_AXES = {"x": 0, "y": 1, "z": 2, 0: 0, 1: 1, 2: 2}


def _num_points(data: dict) -> int:
    if "coord" not in data:
        raise UserError(f"point transforms need a 'coord' entry; the event has {sorted(data)}")
    return len(data["coord"])


def _is_point_array(value: Any, n: int) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim >= 1 and len(value) == n


def index_points(data: dict, index: np.ndarray) -> dict:
    """Select/reorder the points of every per-point entry with ``index``."""
    n = _num_points(data)
    out = dict(data)
    for key, value in data.items():
        if _is_point_array(value, n):
            out[key] = value[torch.as_tensor(index)] if isinstance(value, torch.Tensor) else value[index]
    return out


def _axis(axis: Any) -> int:
    if axis not in _AXES:
        raise UserError(f"axis {axis!r} is not one of 'x', 'y', 'z' (or 0, 1, 2)")
    return _AXES[axis]


@TRANSFORMS.register_module()
class Compose:
    """Apply transforms in order. Items are ``dict(type=...)`` configs (built
    from ``TRANSFORMS``) or callables; ``None``/empty means identity."""

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
class NormalizeCoord:
    """Center ``coord`` and scale it into a unit sphere or box.

    ``center``: ``"mean"`` (centroid), ``"box"`` (bounding-box centre) or a
    fixed 3-vector. ``scale``: ``None`` divides by the event's own extent --
    the largest distance from the centre (``mode="sphere"``, result inside the
    unit ball) or the largest half-side of the bounding box (``mode="box"``,
    result inside [-1, 1]^3); a number divides by that fixed value instead,
    which keeps sizes comparable across events (e.g. ``scale=384`` for the
    768-unit LArTPC cube)."""

    def __init__(self, center: str | Sequence[float] = "mean", scale: float | None = None,
                 mode: str = "sphere"):
        if mode not in ("sphere", "box"):
            raise UserError(f"NormalizeCoord mode={mode!r}: use 'sphere' or 'box'")
        if isinstance(center, str) and center not in ("mean", "box"):
            raise UserError(f"NormalizeCoord center={center!r}: use 'mean', 'box' or a 3-vector")
        if scale is not None and scale <= 0:
            raise UserError(f"NormalizeCoord scale={scale!r} must be positive")
        self.center, self.scale, self.mode = center, scale, mode

    def __call__(self, data: dict) -> dict:
        coord = np.asarray(data["coord"], dtype=np.float64)
        if len(coord) == 0:
            return data
        if isinstance(self.center, str):
            c = coord.mean(0) if self.center == "mean" else (coord.min(0) + coord.max(0)) / 2
        else:
            c = np.asarray(self.center, dtype=np.float64)
        coord = coord - c
        if self.scale is not None:
            s = self.scale
        elif self.mode == "sphere":
            s = np.sqrt((coord**2).sum(1)).max()
        else:
            s = np.abs(coord).max()
        data = dict(data)
        data["coord"] = (coord / (s if s > 0 else 1.0)).astype(np.float32)
        return data


@TRANSFORMS.register_module()
class GridSample:
    """Voxel down-sampling: keep one point per ``grid_size`` cell.

    ``mode="train"`` keeps a random point of each cell (global numpy RNG);
    ``mode="test"`` keeps the first point of each cell in input order, or with
    ``reduce="mean"`` averages the floating-point per-point entries over the
    cell (integer entries such as labels come from its first point).
    Output points are ordered by cell. ``return_grid_coord=True`` adds
    ``grid_coord`` (N,3) int64: ``floor((coord - coord.min(0)) / grid_size)``.
    """

    def __init__(self, grid_size: float | Sequence[float] = 0.01, mode: str = "train",
                 reduce: str = "first", return_grid_coord: bool = False):
        if mode not in ("train", "test"):
            raise UserError(f"GridSample mode={mode!r}: use 'train' or 'test'")
        if reduce not in ("first", "mean"):
            raise UserError(f"GridSample reduce={reduce!r}: use 'first' or 'mean'")
        if np.any(np.asarray(grid_size, dtype=float) <= 0):
            raise UserError(f"GridSample grid_size={grid_size!r} must be positive")
        self.grid_size = np.asarray(grid_size, dtype=np.float64)
        self.mode, self.reduce, self.return_grid_coord = mode, reduce, return_grid_coord

    def __call__(self, data: dict) -> dict:
        coord = np.asarray(data["coord"], dtype=np.float64)
        n = len(coord)
        if n == 0:
            out = dict(data)
            if self.return_grid_coord:
                out["grid_coord"] = np.zeros((0, 3), dtype=np.int64)
            return out
        grid = np.floor((coord - coord.min(0)) / self.grid_size).astype(np.int64)
        dims = grid.max(0) + 1
        key = (grid[:, 0] * dims[1] + grid[:, 1]) * dims[2] + grid[:, 2]
        order = np.argsort(key, kind="stable")
        _, starts, counts = np.unique(key[order], return_index=True, return_counts=True)
        if self.mode == "train":
            pick = order[starts + (np.random.rand(len(starts)) * counts).astype(np.int64)]
        else:
            pick = order[starts]
        out = index_points(data, pick)
        if self.mode == "test" and self.reduce == "mean":
            for k, value in data.items():
                if _is_point_array(value, n) and isinstance(value, np.ndarray) \
                        and np.issubdtype(value.dtype, np.floating):
                    v = value[order]
                    # Points are sorted by cell, so each cell is a contiguous run.
                    sums = np.add.reduceat(v.reshape(n, -1).astype(np.float64), starts, axis=0)
                    out[k] = (sums / counts[:, None]).reshape((len(starts),) + v.shape[1:]).astype(v.dtype)
        if self.return_grid_coord:
            out["grid_coord"] = grid[pick]
        return out


@TRANSFORMS.register_module()
class RandomRotate:
    """Rotate ``coord`` about ``axis`` by an angle drawn uniformly from
    ``angle`` (in multiples of pi, so ``(-1, 1)`` is any angle), around the
    bounding-box centre (``center=True``) or the origin; applied with
    probability ``p``."""

    def __init__(self, angle: Sequence[float] = (-1.0, 1.0), axis: str | int = "z",
                 center: bool = True, p: float = 1.0):
        self.angle, self.axis, self.center, self.p = tuple(angle), _axis(axis), center, p

    def __call__(self, data: dict) -> dict:
        if np.random.rand() >= self.p:
            return data
        theta = np.random.uniform(*self.angle) * np.pi
        c, s = np.cos(theta), np.sin(theta)
        i, j = [a for a in range(3) if a != self.axis]
        rot = np.eye(3)
        rot[i, i], rot[i, j], rot[j, i], rot[j, j] = c, -s, s, c
        coord = np.asarray(data["coord"], dtype=np.float64)
        origin = (coord.min(0) + coord.max(0)) / 2 if self.center and len(coord) else np.zeros(3)
        data = dict(data)
        data["coord"] = ((coord - origin) @ rot.T + origin).astype(np.float32)
        return data


@TRANSFORMS.register_module()
class RandomFlip:
    """Mirror ``coord`` along each of ``axes`` independently with probability
    ``p`` (about the bounding-box centre, so the cloud stays in place)."""

    def __init__(self, p: float = 0.5, axes: Sequence[str | int] = ("x", "y", "z")):
        self.p, self.axes = p, [_axis(a) for a in axes]

    def __call__(self, data: dict) -> dict:
        coord = np.array(data["coord"], dtype=np.float32)
        for a in self.axes:
            if np.random.rand() < self.p and len(coord):
                coord[:, a] = coord[:, a].max() + coord[:, a].min() - coord[:, a]
        data = dict(data)
        data["coord"] = coord
        return data


@TRANSFORMS.register_module()
class RandomJitter:
    """Add Gaussian noise of std ``sigma``, clipped to +-``clip``, to ``coord``."""

    def __init__(self, sigma: float = 0.01, clip: float = 0.05):
        if sigma < 0 or clip <= 0:
            raise UserError(f"RandomJitter needs sigma >= 0 and clip > 0, got {sigma}, {clip}")
        self.sigma, self.clip = sigma, clip

    def __call__(self, data: dict) -> dict:
        coord = np.asarray(data["coord"])
        noise = np.clip(self.sigma * np.random.randn(*coord.shape), -self.clip, self.clip)
        data = dict(data)
        data["coord"] = (coord + noise).astype(np.float32)
        return data


@TRANSFORMS.register_module()
class RandomScale:
    """Multiply ``coord`` by a factor drawn from ``scale`` (one per axis when
    ``anisotropic``), about the origin."""

    def __init__(self, scale: Sequence[float] = (0.95, 1.05), anisotropic: bool = False):
        self.scale, self.anisotropic = tuple(scale), anisotropic

    def __call__(self, data: dict) -> dict:
        factor = np.random.uniform(*self.scale, size=3 if self.anisotropic else 1)
        data = dict(data)
        data["coord"] = (np.asarray(data["coord"]) * factor).astype(np.float32)
        return data


@TRANSFORMS.register_module()
class ShufflePoint:
    """Randomly permute the points (all per-point entries together)."""

    def __call__(self, data: dict) -> dict:
        return index_points(data, np.random.permutation(_num_points(data)))


@TRANSFORMS.register_module()
class LogTransform:
    """``data[out_key] = log1p(data[key] / scale)``: compresses the long tail
    of deposited energies (Bragg peaks, overlapping showers) to O(1) values.
    Negative inputs count as 0. ``out_key`` defaults to ``key`` (in place)."""

    def __init__(self, key: str = "energy", scale: float = 1.0, out_key: str | None = None):
        if scale <= 0:
            raise UserError(f"LogTransform scale={scale!r} must be positive")
        self.key, self.scale, self.out_key = key, scale, out_key or key

    def __call__(self, data: dict) -> dict:
        if self.key not in data:
            raise UserError(f"LogTransform: the event has no {self.key!r} (keys: {sorted(data)})")
        value = np.asarray(data[self.key], dtype=np.float32)
        data = dict(data)
        data[self.out_key] = np.log1p(np.maximum(value, 0.0) / self.scale).astype(np.float32)
        return data


@TRANSFORMS.register_module()
class ToTensor:
    """Convert numpy arrays (and numpy scalars) to torch tensors, keeping the
    dtype except float64 -> float32; other values are left as they are."""

    def __call__(self, data: dict) -> dict:
        out = {}
        for key, value in data.items():
            if isinstance(value, np.ndarray) and value.dtype != object:
                value = torch.from_numpy(np.ascontiguousarray(value))
                if value.dtype == torch.float64:
                    value = value.float()
            elif isinstance(value, np.generic):
                value = torch.as_tensor(value.item())
            out[key] = value
        return out


@TRANSFORMS.register_module()
class Collect:
    """Keep only ``keys`` and build ``feat`` by concatenating ``feat_keys``
    along dim 1 (1-D entries become one column). Works on numpy arrays and
    tensors; ``feat`` is float32."""

    def __init__(self, keys: Sequence[str] = ("coord", "segment"),
                 feat_keys: Sequence[str] = ("coord", "energy")):
        self.keys = (keys,) if isinstance(keys, str) else tuple(keys)
        self.feat_keys = (feat_keys,) if isinstance(feat_keys, str) else tuple(feat_keys)

    def __call__(self, data: dict) -> dict:
        missing = [k for k in self.keys + self.feat_keys if k not in data]
        if missing:
            raise UserError(f"Collect: the event has no {missing} (available: {sorted(data)})")
        out = {k: data[k] for k in self.keys}
        if self.feat_keys:
            cols = [data[k] for k in self.feat_keys]
            if all(isinstance(c, torch.Tensor) for c in cols):
                out["feat"] = torch.cat([_as_columns(c).float() for c in cols], dim=1)
            else:
                out["feat"] = np.concatenate([_as_columns(np.asarray(c, dtype=np.float32)) for c in cols], axis=1)
        return out


def _as_columns(x):
    """(N,) -> (N,1); (N,a,b,...) -> (N,a*b*...); explicit so empty events work."""
    return x.reshape(x.shape[0], int(np.prod(x.shape[1:], dtype=np.int64)))
