"""Instance, label and local-shape transforms, under upstream pimm's names
and arguments: :class:`InstanceParser` (dense instance ids, per-instance
boxes and principal axes), :class:`LocalCovarianceFeatures` (per-point
neighbourhood eigenvalues) and :class:`PDGToSemantic` (labels from PDG codes
when a data set has no label file).

Neighbours are found exactly (:func:`pimm.datasets.neighbours.knn`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import Choice, DictOf, Int, Key, Pair, PosInt, Positive, Real, Rule, Seq

from .neighbours import knn
from .transform_args import check_args, need

__all__ = ["InstanceParser", "LocalCovarianceFeatures", "PDGToSemantic"]

@TRANSFORMS.register_module()
class InstanceParser:
    """Dense instance ids and per-instance geometry.

    Points whose ``segment`` is in ``segment_ignore_index`` get instance
    ``instance_ignore_index``; the other instances are renumbered
    ``0..K-1`` (in order of their old ids). Writes ``instance`` (1-D),
    per-point ``instance_centroid`` (N, 3; the instance's mean point) and
    per-instance ``bbox`` (K, 8: box centre, box size, 0, class), the class
    being the instance's segment shifted down past the ignored non-negative
    labels. With ``compute_axis_stats``: the instance's principal axis
    (PCA of instances with at least ``axis_min_points`` points; else
    ``axis_default``) as per-point ``instance_axis``, the projection on it
    ``instance_axis_coord`` (and divided by the half extent, or the extent
    when not ``axis_normalize_half_extent``: ``instance_axis_coord_normalized``),
    ``instance_axis_length`` and the weights ``instance_axis_weight`` /
    ``instance_axis_coord_weight`` (1 where the axis is valid)."""

    domains = dict(segment_ignore_index=Seq(Int(-10**9)), instance_ignore_index=Int(-10**9),
                   axis_min_points=Int(-10**9), axis_eps=Real(0, 1), axis_default=Seq(Real(-1e9), length=3))
    domain_rules = (Rule(lambda a: any(v != 0 for v in a.axis_default), "axis_default", "a non-zero 3-vector"),)

    def __init__(self, segment_ignore_index: Sequence[int] = (-1, 0, 1), instance_ignore_index: int = -1,
                 compute_axis_stats: bool = False, axis_min_points: int = 5, axis_eps: float = 1e-6,
                 axis_default: Sequence[float] = (1.0, 0.0, 0.0), axis_normalize_half_extent: bool = True):
        check_args(self, segment_ignore_index=segment_ignore_index, instance_ignore_index=instance_ignore_index,
                   axis_min_points=axis_min_points, axis_eps=axis_eps, axis_default=axis_default)
        self.segment_ignore_index = tuple(segment_ignore_index)
        self.instance_ignore_index = int(instance_ignore_index)
        self.vacant = [i for i in self.segment_ignore_index if i >= 0]
        self.compute_axis_stats, self.axis_min_points = bool(compute_axis_stats), max(int(axis_min_points), 1)
        self.axis_eps = float(axis_eps)
        default = np.asarray(axis_default, dtype=np.float32)
        self.axis_default = default / np.linalg.norm(default)
        self.half_extent = bool(axis_normalize_half_extent)

    def _axis(self, points: np.ndarray, centroid: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray, float, bool]:
        """(axis, projections, length, valid) of one instance."""
        none = (self.axis_default.astype(dtype), np.zeros(len(points), dtype=dtype), 0.0, False)
        if len(points) < self.axis_min_points:
            return none
        centered = points.astype(np.float32) - centroid.astype(np.float32)
        if np.linalg.norm(centered, axis=1).max() <= self.axis_eps:
            return none
        values, vectors = np.linalg.eigh(centered.T @ centered / np.float32(len(points)))
        top = int(np.argmax(values))
        axis = vectors[:, top].astype(np.float32)
        norm = float(np.linalg.norm(axis))
        if not (norm > self.axis_eps and float(values[top]) > self.axis_eps):
            return none
        axis = axis / norm
        projection = centered @ axis
        length = float(projection.max()) - float(projection.min())
        if length <= self.axis_eps:
            return none
        return axis.astype(dtype), projection.astype(dtype), length, True

    def __call__(self, data: dict) -> dict:
        coord = np.asarray(need(data, "coord", "InstanceParser"))
        dtype, n = coord.dtype, coord.shape[0]
        segment = np.asarray(need(data, "segment", "InstanceParser")).reshape(-1)
        instance = np.array(need(data, "instance", "InstanceParser"), copy=True).reshape(-1)
        kept = ~np.isin(segment, self.segment_ignore_index)
        instance[~kept] = self.instance_ignore_index
        ids, dense = np.unique(instance[kept], return_inverse=True)
        instance[kept] = dense.reshape(-1)
        fill = self.instance_ignore_index
        centroid = np.full((n, 3), fill, dtype=dtype)
        bbox = np.full((len(ids), 8), fill, dtype=dtype)
        stats = None
        if self.compute_axis_stats:
            stats = dict(instance_axis=np.tile(self.axis_default.astype(dtype), (n, 1)),
                         instance_axis_coord=np.zeros(n, dtype), instance_axis_coord_normalized=np.zeros(n, dtype),
                         instance_axis_length=np.zeros(n, dtype), instance_axis_weight=np.zeros(n, dtype))
        for i in range(len(ids)):
            mask = instance == i
            points = coord[mask]
            low, high, mean = points.min(0), points.max(0), points.mean(0)
            label = np.array([segment[mask][0]], dtype=dtype)
            label -= np.greater(label, self.vacant).sum()
            centroid[mask] = mean.astype(dtype)
            bbox[i] = np.concatenate([(high + low) / 2, high - low, np.zeros(1, dtype), label]).astype(dtype)
            if stats is not None:
                axis, projection, length, valid = self._axis(points, mean, dtype)
                scale = length * 0.5 if self.half_extent else length
                stats["instance_axis"][mask] = axis
                stats["instance_axis_coord"][mask] = projection
                stats["instance_axis_coord_normalized"][mask] = (projection / (float(scale) + self.axis_eps)
                                                                 if valid else 0.0)
                stats["instance_axis_length"][mask] = length
                stats["instance_axis_weight"][mask] = 1.0 if valid else 0.0
        out = dict(data)
        out.update(instance=instance, instance_centroid=centroid, bbox=bbox)
        if stats is not None:
            out.update(stats, instance_axis_coord_weight=stats["instance_axis_weight"].copy())
        return out


@TRANSFORMS.register_module()
class LocalCovarianceFeatures:
    """Per point, the covariance of its ``k`` nearest neighbours (itself
    excluded unless ``include_self``; Gaussian-weighted by distance with
    ``gaussian_weight``, bandwidth ``gaussian_sigma`` or each point's median
    neighbour distance): ``out_keys[0]`` (default ``local_eigvals``) the
    eigenvalues, largest first (N, 3); ``out_keys[1]`` (``local_shape``)
    ``l2/l1, l3/l2, l3/l1, l3/(l1+l2+l3)`` (N, 4). Both are per-point entries
    (added to ``index_valid_keys`` when the event lists them)."""

    domains = dict(k=PosInt, gaussian_sigma=Positive | None, out_keys=Pair(Key) | Seq(Key, length=2))

    def __init__(self, k: int = 16, include_self: bool = False, gaussian_weight: bool = False,
                 gaussian_sigma: float | None = None, out_keys: Sequence[str] = ("local_eigvals", "local_shape")):
        check_args(self, k=k, gaussian_sigma=gaussian_sigma, out_keys=out_keys)
        self.k, self.include_self, self.gaussian_weight = int(k), bool(include_self), bool(gaussian_weight)
        self.gaussian_sigma, self.out_keys = gaussian_sigma, tuple(out_keys)

    def __call__(self, data: dict) -> dict:
        if "coord" not in data or len(data["coord"]) == 0:
            return data
        coord = np.asarray(data["coord"]).astype(np.float32)
        n = coord.shape[0]
        dists, index = knn(coord, min(self.k + (0 if self.include_self else 1), n))
        if not self.include_self:
            dists, index = dists[:, 1:], index[:, 1:]
        offsets = coord[index] - coord[:, None, :]
        if self.gaussian_weight:
            sigma = (np.median(dists, axis=1, keepdims=True) + 1e-6 if self.gaussian_sigma is None
                     else float(self.gaussian_sigma))
            w = np.exp(-0.5 * (dists / (sigma + 1e-6)) ** 2).astype(np.float32)
            total = w.sum(1, keepdims=True) + 1e-6
            centered = offsets - (offsets * w[..., None]).sum(1, keepdims=True) / total[..., None]
            cov = np.einsum("nki,nkj->nij", centered * w[..., None], centered) / total[..., None]
        else:
            centered = offsets - offsets.mean(1, keepdims=True)
            cov = np.einsum("nki,nkj->nij", centered, centered) / float(max(1, centered.shape[1] - 1))
        eig = np.clip(np.linalg.eigvalsh(cov), 0.0, None)[:, ::-1]
        l1, l2, l3 = (eig[:, i] + 1e-12 for i in range(3))
        shape = np.stack([l2 / l1, l3 / l2, l3 / l1, l3 / (l1 + l2 + l3 + 1e-12)], axis=1)
        out = dict(data)
        out[self.out_keys[0]] = eig.astype(coord.dtype)
        out[self.out_keys[1]] = shape.astype(coord.dtype)
        if "index_valid_keys" in data:
            out["index_valid_keys"] = [*data["index_valid_keys"],
                                       *(k for k in self.out_keys if k not in data["index_valid_keys"])]
        return out


_MOTIF = {22: 0, 11: 0, -11: 0, 13: 1, -13: 1, 211: 1, -211: 1, 2212: 1, 321: 1, -321: 1}
_PID = {22: 0, 11: 1, -11: 1, 13: 2, -13: 2, 211: 3, -211: 3, 2212: 4}


def _dense_ids(ids: np.ndarray) -> np.ndarray:
    """(N, 1) int32: ids >= 0 renumbered 0..K-1 in sorted order, the rest -1."""
    out = np.full(len(ids), -1, dtype=np.int32)
    valid = ids >= 0
    if valid.any():
        out[valid] = np.unique(ids[valid], return_inverse=True)[1].reshape(-1)
    return out[:, None]


@TRANSFORMS.register_module()
class PDGToSemantic:
    """Labels from each point's PDG code (``pdg``), for data without a label
    file; an event that already has ``segment`` or ``segment_motif`` passes.

    ``scheme``: ``"motif_5cls"`` (shower 0, track 1; other codes 4) also
    writes ``segment_pid``; ``"pid_6cls"`` (photon 0, electron 1, muon 2,
    pion 3, proton 4, other 5) writes it to both; ``"custom"`` uses
    ``custom_map`` ``{pdg: class}`` (unlisted codes: one past the largest
    class); ``"none"`` does nothing. Also ``instance_particle`` from
    ``track_ids`` and ``instance_interaction`` / ``segment_interaction`` from
    ``interaction_ids`` when those are present and the instances absent."""

    domains = dict(scheme=Choice("motif_5cls", "pid_6cls", "custom", "none"),
                   custom_map=DictOf(Int(-10**12, 10**12), Int(0, 10**6)) | None)
    domain_rules = (Rule(lambda a: a.scheme != "custom" or bool(a.custom_map), "custom_map",
                         "a non-empty {pdg_code: class} dict when scheme='custom'"),)

    def __init__(self, scheme: str = "motif_5cls", custom_map: dict | None = None):
        check_args(self, scheme=scheme, custom_map=custom_map)
        self.scheme = scheme
        self.mapping, self.default = {"motif_5cls": (_MOTIF, 4), "pid_6cls": (_PID, 5), "none": (None, -1)}.get(
            scheme, (custom_map, None))
        if scheme == "custom":
            self.mapping = {int(k): int(v) for k, v in custom_map.items()}
            self.default = max(self.mapping.values()) + 1

    @staticmethod
    def _classes(pdg: np.ndarray, mapping: dict, default: int) -> np.ndarray:
        labels = np.full(len(pdg), default, dtype=np.int32)
        for code, label in mapping.items():
            labels[pdg == code] = label
        return labels[:, None]

    def __call__(self, data: dict) -> dict:
        if self.mapping is None or "pdg" not in data or "segment" in data or "segment_motif" in data:
            return data
        pdg = np.asarray(data["pdg"]).reshape(-1)
        out = dict(data)
        out["segment_motif"] = self._classes(pdg, self.mapping, self.default)
        if self.scheme == "motif_5cls":
            out["segment_pid"] = self._classes(pdg, _PID, 5)
        elif self.scheme == "pid_6cls":
            out["segment_pid"] = out["segment_motif"].copy()
        if "instance_particle" not in data and "track_ids" in data:
            out["instance_particle"] = _dense_ids(np.asarray(data["track_ids"]).reshape(-1))
        if "instance_interaction" not in data and "interaction_ids" in data:
            interaction = np.asarray(data["interaction_ids"]).reshape(-1)
            out["instance_interaction"] = _dense_ids(interaction)
            out["segment_interaction"] = (interaction[:, None] != -1).astype(np.int32)
        return out
