"""Instance segmentation: PointGroupLite (semantic + centroid-offset heads) and
its vectorised clustering.

Each point predicts its class and the vector to its instance centroid
(targets are scatter means of the ``instance`` ids). At eval time points are
grouped in two stages, per event and per predicted class:

1. *fragments*: connected components of the voxel-adjacency graph whose edges
   are kept only where the two voxels' shifted positions (coord + offset)
   agree within ``agree_radius``. Following voxels along a track is robust
   even when a long track's centroid votes are imprecise, while two particles
   touching at a vertex vote for different centroids and are cut apart.
2. *merging*: fragments whose mean votes fall within ``merge_radius`` (voxel
   hashing of the votes) are joined, which reassembles electromagnetic showers
   whose pieces are separated by photon gaps.

Everything is tensor code: no per-point Python loop. Points of
``stuff_classes`` (e.g. low-energy deposits, which carry no instance) and
clusters smaller than ``min_points`` get ``-1``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError

from .losses import build_criteria
from .point_ops import (
    connected_components,
    event_grid_coord,
    neighbor_pairs,
    offset2batch,
    scatter_mean,
    voxelize,
)
from .segmentors import build_backbone

__all__ = ["PointGroupLite", "cluster_instances", "instance_centroid_offsets"]

_NEIGHBORS_26 = torch.tensor([[x, y, z] for x in (-1, 0, 1) for y in (-1, 0, 1) for z in (-1, 0, 1)
                              if (x, y, z) != (0, 0, 0)])


def instance_centroid_offsets(coord: torch.Tensor, instance: torch.Tensor, batch: torch.Tensor):
    """Vector from every point to the centroid of its instance, and the mask of
    points that have an instance (``instance >= 0``). Instances are keyed by
    (event, id), so ids need only be unique within an event."""
    valid = instance >= 0
    target = torch.zeros_like(coord)
    if valid.any():
        key = batch[valid] * (int(instance.max()) + 1) + instance[valid]
        _, inv = torch.unique(key, return_inverse=True)
        centroid = scatter_mean(coord[valid], inv, int(inv.max()) + 1)
        target[valid] = centroid[inv] - coord[valid]
    return target, valid


def _compact(labels: torch.Tensor) -> torch.Tensor:
    return torch.unique(labels, return_inverse=True)[1]


def _radius_table(value, num_events: int, num_classes: int, like: torch.Tensor) -> torch.Tensor:
    """A radius per (event, class) group, flat ``(num_events * num_classes,)``
    indexed by ``event * num_classes + class``: from one value (every class),
    one per class, or a ``(num_events, classes)`` tensor (per event and class)."""
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        if value.shape[0] != num_events or value.shape[1] < num_classes:
            raise ConfigError(f"cluster_instances: per-event radii of shape {tuple(value.shape)} for "
                              f"{num_events} events and {num_classes} classes")
        return value[:, :num_classes].to(like).reshape(-1)
    if isinstance(value, (int, float)):
        return like.new_full((num_events * num_classes,), float(value))
    values = like.new_tensor([float(v) for v in value])
    if len(values) < num_classes:
        raise ConfigError(f"cluster_instances: {len(values)} per-class radii for {num_classes} classes")
    return values[:num_classes].repeat(num_events)


def cluster_instances(
    coord: torch.Tensor,
    shifted: torch.Tensor,
    semantic: torch.Tensor,
    batch: torch.Tensor,
    grid_size: float,
    agree_radius: float | Sequence[float] | torch.Tensor,
    merge_radius: float | Sequence[float] | torch.Tensor,
    min_points: int = 1,
    stuff_classes: Sequence[int] = (),
) -> torch.Tensor:
    """Group points into instances (see the module docstring).

    Args:
        coord: (N,3) point positions; ``grid_size`` is their voxel edge.
        shifted: (N,3) centroid votes (``coord + offset_pred``).
        semantic: (N,) predicted class; instances never span two classes.
        batch: (N,) event index; instances never span two events.
        agree_radius, merge_radius: one value, one per class (showers are
            diffuse and their votes scatter more than a track's), or a
            ``(events, classes)`` tensor: one per event and class (a policy
            choosing radii event by event, :mod:`pimm.models.grpo.cluster_policy`).

    Returns (N,) long instance ids, unique across the batch, -1 = unassigned.
    """
    out = torch.full_like(semantic, -1)
    stuff = torch.tensor(list(stuff_classes), dtype=semantic.dtype, device=semantic.device)
    idx = torch.nonzero(~torch.isin(semantic, stuff)).squeeze(1)
    if idx.numel() == 0:
        return out
    num_classes = int(semantic.max()) + 1
    group = batch[idx] * num_classes + semantic[idx]  # one graph per (event, class)
    votes = shifted[idx]
    num_events = int(batch.max()) + 1
    agree_r = _radius_table(agree_radius, num_events, num_classes, votes)
    merge_r = _radius_table(merge_radius, num_events, num_classes, votes)

    # Stage 1: fragments along voxel adjacency where the votes agree.
    vgrid, vgroup, inv = voxelize(event_grid_coord(coord[idx], group, grid_size), group)
    vvote = scatter_mean(votes, inv, vgrid.shape[0])
    a, b, _ = neighbor_pairs(vgrid, vgroup, _NEIGHBORS_26.to(vgrid.device))
    agree = (vvote[a] - vvote[b]).norm(dim=1) <= agree_r[vgroup[a]]
    frag = _compact(connected_components(vgrid.shape[0], a[agree], b[agree]))[inv]

    # Stage 2: merge fragments whose mean votes are close. Fragments are linked
    # to a hash cell of their vote (cells of the class's merge radius);
    # occupied neighbouring cells are linked too.
    num_frag = int(frag.max()) + 1
    fgroup = torch.zeros(num_frag, dtype=group.dtype, device=group.device).scatter_(0, frag, group)
    fvote = scatter_mean(votes, frag, num_frag) / merge_r[fgroup, None]
    cell_grid = event_grid_coord(fvote, fgroup, 1.0)
    cgrid, cgroup, cell_of_frag = voxelize(cell_grid, fgroup)
    ca, cb, _ = neighbor_pairs(cgrid, cgroup, _NEIGHBORS_26.to(cgrid.device))
    # Graph nodes: fragments [0, F) then cells [F, F + C).
    src = torch.cat([torch.arange(num_frag, device=frag.device), ca + num_frag])
    dst = torch.cat([cell_of_frag + num_frag, cb + num_frag])
    merged = connected_components(num_frag + cgrid.shape[0], src, dst)[:num_frag]

    labels = _compact(merged[frag])
    sizes = torch.bincount(labels)
    keep = sizes[labels] >= min_points
    labels = torch.where(keep, labels, torch.full_like(labels, -1))
    out[idx] = labels
    valid = out >= 0
    out[valid] = _compact(out[valid])
    return out


@MODELS.register_module()
class PointGroupLite(nn.Module):
    """Backbone + semantic head + centroid-offset head, with clustering at eval.

    Args:
        backbone: backbone config, built through ``MODELS``.
        num_classes: number of semantic classes.
        criteria: semantic loss configs (default: cross-entropy, ignore -1).
        grid_size: voxel edge of ``coord`` (used by the clustering adjacency).
        offset_scale: the offset head's output is multiplied by this, and the
            offset loss is measured in these units, so that offsets of tens of
            voxels are O(1) for the network.
        offset_weight, direction_weight: weights of the L1 offset loss and the
            (1 - cosine) direction loss.
        agree_radius, merge_radius, min_points, stuff_classes: clustering
            parameters (coordinate units; the radii may be per-class tuples),
            see :func:`cluster_instances`.

    ``forward`` returns ``seg_logits``, ``offset_pred``, ``loss`` (when
    ``segment`` and ``instance`` are given) and, in eval mode,
    ``instance_pred``.
    """

    def __init__(
        self,
        backbone: dict,
        num_classes: int,
        criteria: Sequence[dict] | None = None,
        grid_size: float = 1.0,
        offset_scale: float = 1.0,
        offset_weight: float = 1.0,
        direction_weight: float = 1.0,
        agree_radius: float | Sequence[float] = 4.0,
        merge_radius: float | Sequence[float] = 8.0,
        min_points: int = 1,
        stuff_classes: Sequence[int] = (),
    ):
        super().__init__()
        if int(num_classes) < 1:
            raise ConfigError(f"PointGroupLite: num_classes must be >= 1, got {num_classes}")
        radii = [grid_size, offset_scale]
        for r in (agree_radius, merge_radius):
            radii += list(r) if isinstance(r, (list, tuple)) else [r]
        if min(radii) <= 0:
            raise ConfigError("PointGroupLite: grid_size, offset_scale, agree_radius and merge_radius must be > 0")
        self.num_classes = int(num_classes)
        self.backbone, width = build_backbone(backbone, "PointGroupLite")
        self.seg_head = nn.Linear(width, self.num_classes)
        self.offset_head = nn.Sequential(
            nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 3)
        )
        self.criteria = build_criteria(criteria or [dict(type="CrossEntropyLoss", ignore_index=-1)])
        self.grid_size = float(grid_size)
        self.offset_scale = float(offset_scale)
        self.offset_weight = float(offset_weight)
        self.direction_weight = float(direction_weight)
        self.agree_radius = tuple(agree_radius) if isinstance(agree_radius, (list, tuple)) else float(agree_radius)
        self.merge_radius = tuple(merge_radius) if isinstance(merge_radius, (list, tuple)) else float(merge_radius)
        self.min_points = int(min_points)
        self.stuff_classes = tuple(int(c) for c in stuff_classes)

    def offset_loss(self, offset_pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if not bool(valid.any()):
            return offset_pred.sum() * 0.0
        pred, tgt = offset_pred[valid], target[valid]
        l1 = (pred - tgt).abs().sum(1).mean() / self.offset_scale
        # Direction only where the target has one (points away from the centroid).
        has_dir = tgt.norm(dim=1) > 1e-6 * self.offset_scale
        cos = F.cosine_similarity(pred[has_dir], tgt[has_dir], dim=1, eps=1e-8)
        direction = (1.0 - cos).mean() if cos.numel() else pred.sum() * 0.0
        return self.offset_weight * l1 + self.direction_weight * direction

    def forward(self, input_dict: dict) -> dict[str, torch.Tensor]:
        feat = self.backbone(input_dict)
        seg_logits = self.seg_head(feat)
        offset_pred = self.offset_head(feat) * self.offset_scale
        out = {"seg_logits": seg_logits, "offset_pred": offset_pred}
        coord = input_dict["coord"]
        batch = offset2batch(input_dict["offset"].to(coord.device))
        if "segment" in input_dict and "instance" in input_dict:
            target, valid = instance_centroid_offsets(coord, input_dict["instance"].long(), batch)
            out["loss"] = self.criteria(seg_logits, input_dict["segment"].long()) + self.offset_loss(
                offset_pred, target, valid
            )
        if not self.training:
            with torch.no_grad():
                out["instance_pred"] = cluster_instances(
                    coord, coord + offset_pred, seg_logits.argmax(1), batch, self.grid_size,
                    self.agree_radius, self.merge_radius, self.min_points, self.stuff_classes,
                )
        return out
