"""Instance segmentation: PointGroupLite (semantic + centroid-offset heads),
the baseline instance model.

Each point predicts its class and the vector to its instance centroid
(targets are scatter means of the ``instance`` ids). At eval time points are
grouped per event and per predicted class by :func:`cluster_instances`
(:mod:`pimm.models.clustering`): fragments along voxel adjacency where the
votes (coord + offset) agree, then fragments whose mean votes are close are
joined, which reassembles showers split by photon gaps. The offset head and
its loss are shared with :class:`~pimm.models.instance_affinity.PointGroupAffinity`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError

from .clustering import cluster_instances
from .losses import CriteriaFitLogits, build_criteria
from .point_ops import offset2batch, scatter_mean
from .segmentors import build_backbone
from pimm.utils.config_domains import answers_with
from pimm.utils.domains import Count, Int, Length, MAX_SIZE, PosInt, Registered, Seq, Weight

__all__ = ["PointGroupLite", "centroid_offset_loss", "cluster_instances", "instance_centroid_offsets",
           "make_offset_head"]


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


def make_offset_head(width: int) -> nn.Sequential:
    """Linear-BN-ReLU-Linear from backbone features to a 3D offset."""
    return nn.Sequential(nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 3))


def centroid_offset_loss(offset_pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, offset_scale: float,
                         offset_weight: float, direction_weight: float) -> torch.Tensor:
    """``offset_weight * L1 / offset_scale + direction_weight * (1 - cos)``
    over the points with an instance; the direction term only where the
    target has one (points away from their centroid)."""
    if not bool(valid.any()):
        return offset_pred.sum() * 0.0
    pred, tgt = offset_pred[valid], target[valid]
    l1 = (pred - tgt).abs().sum(1).mean() / offset_scale
    has_dir = tgt.norm(dim=1) > 1e-6 * offset_scale
    cos = F.cosine_similarity(pred[has_dir], tgt[has_dir], dim=1, eps=1e-8)
    direction = (1.0 - cos).mean() if cos.numel() else pred.sum() * 0.0
    return offset_weight * l1 + direction_weight * direction


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
        agree_radius, merge_radius, min_points, stuff_classes, absorb_points:
            clustering parameters (coordinate units; the radii may be
            per-class tuples), see :func:`cluster_instances`.

    ``forward`` returns ``seg_logits``, ``offset_pred``, ``loss`` (when
    ``segment`` and ``instance`` are given) and, in eval mode,
    ``instance_pred``.
    """

    domains = dict(backbone=Registered("model"), num_classes=Int(1, MAX_SIZE),
                   criteria=Seq(Registered("loss")) | None, grid_size=Length, offset_scale=Length,
                   offset_weight=Weight, direction_weight=Weight, agree_radius=Length | Seq(Length, min_len=1),
                   merge_radius=Length | Seq(Length, min_len=1), min_points=PosInt | Seq(PosInt, min_len=1),
                   stuff_classes=Seq(Int(0, MAX_SIZE)), absorb_points=Count)
    output_classes = answers_with("num_classes")  # the columns of seg_logits
    domain_rules = (CriteriaFitLogits(),)

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
        min_points: int | Sequence[int] = 1,
        stuff_classes: Sequence[int] = (),
        absorb_points: int = 0,
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
        self.offset_head = make_offset_head(width)
        self.criteria = build_criteria(criteria or [dict(type="CrossEntropyLoss", ignore_index=-1)], int(num_classes))
        self.grid_size = float(grid_size)
        self.offset_scale = float(offset_scale)
        self.offset_weight = float(offset_weight)
        self.direction_weight = float(direction_weight)
        self.agree_radius = tuple(agree_radius) if isinstance(agree_radius, (list, tuple)) else float(agree_radius)
        self.merge_radius = tuple(merge_radius) if isinstance(merge_radius, (list, tuple)) else float(merge_radius)
        self.min_points = tuple(int(m) for m in min_points) if isinstance(min_points, (list, tuple)) \
            else int(min_points)
        self.stuff_classes = tuple(int(c) for c in stuff_classes)
        if int(absorb_points) < 0:
            raise ConfigError(f"PointGroupLite: absorb_points must be >= 0 (0: off), got {absorb_points}")
        self.absorb_points = int(absorb_points)

    def offset_loss(self, offset_pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return centroid_offset_loss(offset_pred, target, valid, self.offset_scale, self.offset_weight,
                                    self.direction_weight)

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
                    self.absorb_points,
                )
        return out
