"""Anchor mining for LArTPC events, and :class:`ComputeAnchors`, upstream
pimm's transform that attaches the anchors to an event.

Anchors are points where something happens along a particle's path, found
from geometry and deposited energy alone (no labels), for view samplers that
centre crops on them:

* ``endpoints``: points with a single close neighbour (after thinning the
  k-nearest-neighbour graph at each point's median neighbour distance); in
  shower-like regions only those whose furthest neighbours along the local
  direction carry at least the local median energy;
* ``branches_track``: points with three or more close neighbours, or in the
  top 5% of local curvature;
* ``branches_shower``: shower-like points with a neighbour that carries at
  least ``branch_energy_frac`` of the local energy at an angle of at least
  ``branch_min_angle_deg`` from the local direction;
* ``bragg``: endpoints whose energy stands ``bragg_sigma`` standard
  deviations above the ``bragg_window`` neighbours ahead of them;
* ``led``: points of small, low-energy clusters (connected components of the
  short-edge neighbour graph with fewer than ``min_cluster_pts`` points and
  less than the median energy per point); excluded from all of the above.

"Shower-like": a local scattering ``l3 / l1`` (smallest over largest
eigenvalue of the neighbours' covariance) in the event's top 45%.
"""

from __future__ import annotations

import numpy as np
import torch

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import Choice, DictOf, Real
from pimm.utils.errors import UserError

from .neighbours import knn
from .transform_args import check_args, need

__all__ = ["ANCHOR_DEFAULT_CFG", "ANCHOR_KEYS", "compute_anchors", "ComputeAnchors"]

ANCHOR_DEFAULT_CFG = dict(k=16, r_vox=6.0, min_cluster_pts=8, endpoint_contig=3, branch_energy_frac=0.10,
                          branch_min_angle_deg=15.0, bragg_window=7, bragg_sigma=2.0, anchor_radius_scale=1.5)
ANCHOR_KEYS = ("endpoints", "branches_track", "branches_shower", "bragg", "led")


def _components(n: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Connected-component labels (each the smallest index in its component)
    of the undirected graph with edges ``rows[i] -- cols[i]``."""
    labels = np.arange(n)
    while True:
        before = labels.copy()
        np.minimum.at(labels, rows, labels[cols])
        np.minimum.at(labels, cols, labels[rows])
        labels = labels[labels]  # pointer jumping: follow each label to its own label
        if np.array_equal(labels, before):
            return labels


def _small_dim_clusters(index: np.ndarray, dist: np.ndarray, energy: np.ndarray, min_points: int) -> np.ndarray:
    threshold = float(np.quantile(dist[:, 0], 0.5)) * 1.5 + 1e-8 if dist.size else 1e-8
    close = dist < threshold
    rows = np.repeat(np.arange(len(index)), index.shape[1])[close.reshape(-1)]
    labels = _components(len(index), rows, index.reshape(-1)[close.reshape(-1)])
    size = np.bincount(labels, minlength=len(index))
    total = np.bincount(labels, weights=energy, minlength=len(index))
    median = float(np.median(energy)) if energy.size else 0.0
    return ((size < min_points) & (total < median * size))[labels]


def _quantile(x: np.ndarray, q: float, default: float) -> float:
    return float(np.quantile(x, q)) if x.size else default


def compute_anchors(xyz, energy, is_shower_like=None, cfg: dict | None = None) -> dict[str, np.ndarray]:
    """Anchors of one event (see the module doc): a dict of (M, 3) float32
    point sets keyed by :data:`ANCHOR_KEYS`. ``is_shower_like``: a per-point
    mask to use instead of the scattering rule."""
    xyz = (xyz.detach().cpu().numpy() if isinstance(xyz, torch.Tensor) else np.asarray(xyz)).astype(np.float32)
    energy = (energy.detach().cpu().numpy() if isinstance(energy, torch.Tensor) else np.asarray(energy)).reshape(-1)
    cfg = {**ANCHOR_DEFAULT_CFG, **(cfg or {})}
    n = xyz.shape[0]
    if n < 2:
        return {key: np.zeros((0, 3), dtype=np.float32) for key in ANCHOR_KEYS}
    k = int(cfg["k"])
    dist, index = knn(xyz, min(k + 1, n))
    dist, index = dist[:, 1:k + 1].astype(np.float32), index[:, 1:k + 1].astype(np.int64)
    neighbours = xyz[index]
    centered = torch.from_numpy((neighbours - neighbours.mean(axis=1, keepdims=True)).astype(np.float32))
    values, vectors = torch.linalg.eigh(torch.matmul(centered.transpose(1, 2), centered) / float(index.shape[1]))
    values = torch.flip(values, dims=[1])  # largest first
    curvature = (values[:, -1] / torch.clamp(values.sum(dim=1), min=1e-12)).numpy()
    values = values.numpy()
    direction = torch.nn.functional.normalize(vectors[:, :, -1], dim=1).numpy().astype(np.float32)

    led = _small_dim_clusters(index, dist, energy, int(cfg["min_cluster_pts"]))
    degree = (dist < np.median(dist, axis=1, keepdims=True)).sum(axis=1)
    if is_shower_like is None:
        scattering = values[:, 2] / (values[:, 0] + 1e-12)
        shower_like = scattering >= (np.quantile(scattering, 0.55) if scattering.size else 0.0)
    else:
        shower_like = np.asarray(is_shower_like).astype(bool).reshape(-1)

    local_energy = energy[index]
    offsets = neighbours - xyz[:, None, :]
    ahead = np.argsort((offsets * direction[:, None, :]).sum(axis=2), axis=1)  # along the local direction
    endpoints = (degree == 1) & ~led
    if endpoints.any():
        furthest = np.take_along_axis(local_energy, ahead[:, -int(cfg["endpoint_contig"]):], axis=1)
        continuous = (furthest >= np.median(local_energy, axis=1, keepdims=True)).all(axis=1)
        endpoints = np.where(shower_like, endpoints & continuous, endpoints)

    branches_track = ((degree >= 3) | (curvature >= _quantile(curvature, 0.95, float(curvature.max())))) & ~led

    cosine = (offsets * direction[:, None, :]).sum(axis=2) / (
        np.linalg.norm(offsets, axis=2) * np.linalg.norm(direction, axis=1, keepdims=True) + 1e-8)
    sine = np.sqrt(1.0 - np.clip(cosine, -1.0, 1.0) ** 2)
    share = local_energy / (local_energy.sum(axis=1, keepdims=True) + energy[:, None] + 1e-8)
    significant = (share * sine >= float(cfg["branch_energy_frac"])) & (
        sine >= np.sin(np.deg2rad(float(cfg["branch_min_angle_deg"]))))
    branches_shower = significant.any(axis=1) & shower_like & ~led

    bragg = np.zeros(n, dtype=bool)
    if endpoints.any():
        forward = np.take_along_axis(local_energy, ahead[:, -max(3, int(cfg["bragg_window"])):], axis=1)
        peak = forward.mean(axis=1) + float(cfg["bragg_sigma"]) * (forward.std(axis=1) + 1e-8)
        bragg = (energy >= peak) & endpoints & ~led

    masks = dict(endpoints=endpoints, branches_track=branches_track, branches_shower=branches_shower, bragg=bragg,
                 led=led)
    return {key: xyz[masks[key]].reshape(-1, 3).astype(np.float32) for key in ANCHOR_KEYS}


@TRANSFORMS.register_module()
class ComputeAnchors:
    """Attach :func:`compute_anchors` of ``coord`` and ``energy`` as the entry
    ``anchors`` (a dict of (M, 3) point sets). ``cfg`` overrides entries of
    :data:`ANCHOR_DEFAULT_CFG`."""

    domains = dict(cfg=DictOf(Choice(*ANCHOR_DEFAULT_CFG), Real(0, 1e6)) | None)

    def __init__(self, cfg: dict | None = None):
        check_args(self, cfg=cfg)
        self.cfg = dict(cfg or {})
        for key in ("k", "min_cluster_pts", "endpoint_contig", "bragg_window"):
            value = self.cfg.get(key, 1)
            if value != int(value) or value < 1:
                raise UserError(f"ComputeAnchors cfg[{key!r}]={value!r} is invalid: it takes a whole number >= 1")

    def __call__(self, data: dict) -> dict:
        coord = need(data, "coord", "ComputeAnchors")
        energy = np.asarray(need(data, "energy", "ComputeAnchors"))
        out = dict(data)
        out["anchors"] = compute_anchors(np.asarray(coord, dtype=np.float32), energy, cfg=self.cfg)
        return out
