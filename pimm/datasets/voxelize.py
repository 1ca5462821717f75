"""GridSample: voxel down-sampling of a point cloud, with upstream pimm's
arguments and meanings.

The grid is anchored at the origin of the coordinate frame: a point's cell is
``floor(coord / grid_size)``, and ``grid_coord`` is that cell minus the
smallest cell of the event (so it starts at 0 on every axis). Cells are keyed
by a 64-bit hash of the cell index and points are sorted by key, so the
output order is the key order: ``hash_type="fnv"`` (upstream's default; a
scrambled order) or ``"ravel"`` (raster order, x slowest). Both orders are
reproduced exactly, which keeps results comparable with upstream runs.

``mode="train"`` keeps one point per cell (a random one, as upstream; pimm
adds ``reduce="first"`` / ``"mean"`` for deterministic evaluation);
``mode="test"`` returns upstream's *fragments*: a list of events, the i-th
holding the (i mod count)-th point of every cell, which together cover every
input point once or more, each with ``index`` (the input rows it holds).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pimm.engines.registries import TRANSFORMS
from pimm.utils.errors import UserError

from .point_dict import _require, index_points, point_keys
from pimm.utils.domains import Choice, Keys, Length, Seq

__all__ = ["GridSample", "fnv_hash", "ravel_hash"]

_FNV_OFFSET = np.uint64(14695981039346656037)
_FNV_PRIME = np.uint64(1099511628211)


def fnv_hash(cells: np.ndarray) -> np.ndarray:
    """A 64-bit key per row of non-negative integer ``cells`` (N, D): start
    from the FNV offset basis and, per column, multiply by the FNV prime
    (wrapping at 2**64) then xor the column -- the key upstream calls
    ``fnv``, reproduced for its ordering."""
    cells = cells.astype(np.uint64)
    key = np.full(len(cells), _FNV_OFFSET, dtype=np.uint64)
    for column in cells.T:
        key = (key * _FNV_PRIME) ^ column
    return key


def ravel_hash(cells: np.ndarray) -> np.ndarray:
    """Raster index of each row of non-negative integer ``cells`` (first
    column slowest), unique within the event's bounding box."""
    cells = cells.astype(np.uint64)
    extent = cells.max(0) + np.uint64(1) if len(cells) else np.ones(cells.shape[1], dtype=np.uint64)
    key = np.zeros(len(cells), dtype=np.uint64)
    for j in range(cells.shape[1]):
        key = key * extent[j] + cells[:, j]
    return key


_HASHES = {"fnv": fnv_hash, "ravel": ravel_hash}


@TRANSFORMS.register_module()
class GridSample:
    """Keep one point per ``grid_size`` cell (see the module doc).

    Args:
        grid_size: cell edge in ``coord`` units (a number or one per axis).
        hash_type: ``"fnv"`` or ``"ravel"``; sets the output order.
        mode: ``"train"`` (one point per cell) or ``"test"`` (list of fragments).
        return_inverse: add ``inverse`` (input N,): the output row of each input
            point's cell (in test mode, the cell index).
        return_grid_coord: add ``grid_coord`` (N, 3) int64.
        return_min_coord: add ``min_coord`` (1, 3): the grid origin in ``coord`` units.
        return_displacement: add ``displacement`` (N, 3): the point's offset
            from its cell centre in cell units, in [-0.5, 0.5);
            ``project_displacement`` reduces it to (N, 1) along ``normal``.
        sum_keys / min_keys: entries replaced by their sum / minimum over the
            cell (e.g. ``sum_keys=("energy",)`` keeps the deposited energy).
        reduce: which point represents a cell in train mode: ``"random"``
            (upstream), ``"first"`` (first in input order) or ``"mean"``
            (float entries averaged over the cell, others from the first point).
    """

    domains = dict(grid_size=Length | Seq(Length, length=3), hash_type=Choice("fnv", "ravel"),
                   mode=Choice("train", "test"), sum_keys=Keys | None, min_keys=Keys | None,
                   reduce=Choice("random", "first", "mean"))

    def __init__(self, grid_size: float | Sequence[float] = 0.05, hash_type: str = "fnv", mode: str = "train",
                 return_inverse: bool = False, return_grid_coord: bool = False, return_min_coord: bool = False,
                 return_displacement: bool = False, project_displacement: bool = False,
                 sum_keys: Sequence[str] | None = None, min_keys: Sequence[str] | None = None,
                 reduce: str = "random"):
        if mode not in ("train", "test"):
            raise UserError(f"GridSample mode={mode!r}: use 'train' or 'test'")
        if hash_type not in _HASHES:
            raise UserError(f"GridSample hash_type={hash_type!r}: use 'fnv' or 'ravel'")
        if reduce not in ("random", "first", "mean"):
            raise UserError(f"GridSample reduce={reduce!r}: use 'random', 'first' or 'mean'")
        size = np.asarray(grid_size, dtype=np.float64)
        if size.ndim > 1 or size.size not in (1, 3) or np.any(~(size > 0)):
            raise UserError(f"GridSample grid_size={grid_size!r} must be a positive number or three of them")
        self.grid_size, self.hash, self.mode, self.reduce = size, _HASHES[hash_type], mode, reduce
        self.return_inverse, self.return_grid_coord = return_inverse, return_grid_coord
        self.return_min_coord, self.return_displacement = return_min_coord, return_displacement
        self.project_displacement = project_displacement
        self.sum_keys, self.min_keys = tuple(sum_keys or ()), tuple(min_keys or ())

    def __call__(self, data: dict) -> dict | list[dict]:
        coord = np.asarray(_require(data, "coord", "GridSample"), dtype=np.float64)
        scaled = coord / self.grid_size
        cells = np.floor(scaled).astype(np.int64)
        low = cells.min(0) if len(cells) else np.zeros(3, dtype=np.int64)
        grid = cells - low
        key = self.hash(grid)
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        is_start = np.r_[True, sorted_key[1:] != sorted_key[:-1]] if len(key) else np.zeros(0, dtype=bool)
        starts = np.flatnonzero(is_start)
        counts = np.diff(np.r_[starts, len(key)])
        inverse = np.empty(len(key), dtype=np.int64)
        inverse[order] = np.cumsum(is_start) - 1
        extras = dict(grid=grid, low=low, inverse=inverse, offset=scaled - low - grid - 0.5)
        if self.mode == "test":
            parts = []
            for i in range(max(int(counts.max(initial=0)), 1)):
                pick = order[starts + i % counts]
                part = self._finish(data, index_points(data, pick), pick, extras)
                part["index"] = pick
                parts.append(part)
            return parts
        if self.reduce == "random":
            pick = order[starts + (np.random.rand(len(starts)) * counts).astype(np.int64)]
        else:
            pick = order[starts]
        out = index_points(data, pick)
        reduced = self.sum_keys + self.min_keys + (tuple(point_keys(data)) if self.reduce == "mean" else ())
        for k in dict.fromkeys(reduced):
            value = np.asarray(_require(data, k, "GridSample"))
            if k in self.sum_keys:
                out[k] = np.add.reduceat(value[order], starts, axis=0) if len(starts) else value[:0]
            elif k in self.min_keys:
                out[k] = np.minimum.reduceat(value[order], starts, axis=0) if len(starts) else value[:0]
            elif value.dtype.kind == "f" and len(starts):
                mean = np.add.reduceat(value[order].astype(np.float64), starts, axis=0)
                out[k] = (mean / counts.reshape((-1,) + (1,) * (value.ndim - 1))).astype(value.dtype)
        return self._finish(data, out, pick, extras)

    def _finish(self, data: dict, out: dict, pick: np.ndarray, extras: dict) -> dict:
        added = []
        if self.return_inverse:
            out["inverse"] = extras["inverse"]
        if self.return_grid_coord:
            out["grid_coord"] = extras["grid"][pick]
            added.append("grid_coord")
        if self.return_min_coord:
            out["min_coord"] = (extras["low"] * self.grid_size).reshape(1, 3)
        if self.return_displacement:
            displacement = extras["offset"][pick]
            if self.project_displacement:
                normal = np.asarray(_require(data, "normal", "GridSample(project_displacement=True)"))[pick]
                displacement = (displacement * normal).sum(-1, keepdims=True)
            out["displacement"] = displacement.astype(np.float32)
            added.append("displacement")
        if added and "index_valid_keys" in out:  # keep them aligned through later transforms
            out["index_valid_keys"] = list(out["index_valid_keys"]) + [k for k in added
                                                                       if k not in out["index_valid_keys"]]
        return out
