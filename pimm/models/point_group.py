"""``PG-v1m1``: upstream's PointGroup (Jiang et al. 2020, after Pointcept),
with its arguments, defaults and parameter names (``backbone.*``,
``bias_head.{0,1,3}``, ``seg_head``), so its checkpoints load strictly.

A backbone gives per-point features; ``seg_head`` classifies every point and
``bias_head`` (Linear-BN-ReLU-Linear) predicts the vector to its instance's
centroid. Training: cross-entropy on ``segment`` plus the L1 distance and
the negative cosine between the predicted and the true vector
(``instance_centroid - coord``, :class:`~pimm.datasets.transforms_instance.InstanceParser`
writes ``instance_centroid``) over the points with an instance.

Evaluation: the shifted points (``coord + bias``, in units of
``voxel_size``) of every class outside ``segment_ignore_index`` are grouped
by :mod:`pimm.models.pointgroup_ops` -- upstream's CUDA clustering, here as
tensor code on any device: balls of ``cluster_thresh``, same-class
components of at least ``cluster_min_points``; a component is a proposal
when it has more than ``cluster_propose_points`` points. Upstream's outputs
(``pred_masks`` (P, N) int32, ``pred_scores`` -- the mean probability of the
proposal's class over it -- and ``pred_classes``, on the CPU) come with two
more for pimm's evaluators: ``seg_logits`` and ``instance_pred`` (N,), the
proposal of every point (-1: none).

Differences from upstream: a backbone returning a point batch (PT-v3) works
too (its features are walked back to the points as DefaultSegmentorV2
does); a batch without any point to cluster gives no proposals (upstream
stops with an IndexError there); the losses are left out of a batch without
``segment``/``instance``/``instance_centroid`` outside training.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.config_domains import answers_with
from pimm.utils.domains import Int, Length, MAX_SIZE, PosInt, Registered, Seq, Size, Count
from pimm.utils.errors import ConfigError

from .point_ops import offset2batch
from .pointgroup_ops import ballquery_batch_p, bfs_cluster
from .segmentor_v2 import DefaultSegmentorV2

__all__ = ["PointGroup"]

_LABEL = Int(-10**9, 10**9)
_TRUTH = ("segment", "instance", "instance_centroid")


@MODELS.register_module("PG-v1m1")
class PointGroup(nn.Module):
    """Backbone, semantic and centroid-offset heads, clustering at evaluation (module doc).

    Args:
        backbone: backbone config (built through ``MODELS``); upstream's is ``SpUNet-v1m1``.
        backbone_out_channels: width of the backbone's per-point features.
        semantic_num_classes: classes of ``seg_head``.
        semantic_ignore_index: ``segment`` value the cross-entropy skips.
        segment_ignore_index: predicted classes that are never clustered (stuff).
        instance_ignore_index: ``instance`` value of points without an instance.
        cluster_thresh: ball radius of the clustering, in voxels.
        cluster_closed_points: upstream's initial neighbour-list size per point (no effect on the result).
        cluster_propose_points: a component becomes a proposal above this many points.
        cluster_min_points: components below this many points are dropped.
        voxel_size: size of a voxel in ``coord`` units (shifted points are divided by it).
    """

    domains = dict(backbone=Registered("model"), backbone_out_channels=Size, semantic_num_classes=Int(1, MAX_SIZE),
                   semantic_ignore_index=_LABEL, segment_ignore_index=Seq(_LABEL), instance_ignore_index=_LABEL,
                   cluster_thresh=Length, cluster_closed_points=PosInt, cluster_propose_points=Count,
                   cluster_min_points=Count, voxel_size=Length)
    output_classes = answers_with("semantic_num_classes")  # the columns of seg_logits

    def __init__(self, backbone: dict, backbone_out_channels: int = 64, semantic_num_classes: int = 20,
                 semantic_ignore_index: int = -1, segment_ignore_index: Sequence[int] = (-1, 0, 1),
                 instance_ignore_index: int = -1, cluster_thresh: float = 1.5, cluster_closed_points: int = 300,
                 cluster_propose_points: int = 100, cluster_min_points: int = 50, voxel_size: float = 0.02):
        super().__init__()
        if not isinstance(backbone, dict):
            raise ConfigError(f"PG-v1m1: backbone must be a dict(type=...), got {backbone!r}")
        width = int(backbone_out_channels)
        self.semantic_num_classes = int(semantic_num_classes)
        self.semantic_ignore_index = int(semantic_ignore_index)
        self.segment_ignore_index = tuple(int(i) for i in segment_ignore_index)
        self.instance_ignore_index = int(instance_ignore_index)
        self.cluster_thresh = float(cluster_thresh)
        self.cluster_closed_points = int(cluster_closed_points)
        self.cluster_propose_points = int(cluster_propose_points)
        self.cluster_min_points = int(cluster_min_points)
        self.voxel_size = float(voxel_size)
        self.backbone = MODELS.build(backbone)
        declared = getattr(self.backbone, "out_channels", None)
        if isinstance(declared, int) and declared != width:
            raise ConfigError(f"PG-v1m1: backbone_out_channels={width} but the backbone {backbone.get('type')!r} "
                              f"outputs {declared} channels")
        norm = partial(nn.BatchNorm1d, eps=1e-3, momentum=0.01)
        self.bias_head = nn.Sequential(nn.Linear(width, width), norm(width), nn.ReLU(), nn.Linear(width, 3))
        self.seg_head = nn.Linear(width, self.semantic_num_classes)

    def forward(self, data_dict: dict) -> dict:
        feat, _ = DefaultSegmentorV2.point_features(self.backbone(data_dict))
        bias_pred = self.bias_head(feat)
        logit_pred = self.seg_head(feat)
        out = {}
        missing = [key for key in _TRUTH if key not in data_dict]
        if not missing:
            out.update(self.losses(data_dict, bias_pred, logit_pred))
        elif self.training:
            raise ConfigError(f"PG-v1m1 trains on the batch keys {list(_TRUTH)}; the batch lacks {missing} (add "
                              "InstanceParser to the transforms and list instance_centroid in Collect)")
        if not self.training:
            with torch.no_grad():
                out.update(self.proposals(data_dict["coord"], data_dict["offset"], bias_pred, logit_pred))
            out["seg_logits"] = logit_pred
        return out

    def losses(self, data_dict: dict, bias_pred: torch.Tensor, logit_pred: torch.Tensor) -> dict:
        """Upstream's three terms: cross-entropy, and over the points with an
        instance the mean L1 distance and the mean negative cosine between the
        predicted and the true centroid offset."""
        coord = data_dict["coord"]
        segment = data_dict["segment"].reshape(-1).long()
        seg_loss = F.cross_entropy(logit_pred, segment, ignore_index=self.semantic_ignore_index)
        has_instance = (data_dict["instance"].reshape(-1) != self.instance_ignore_index).float()
        denominator = has_instance.sum() + 1e-8
        bias_gt = data_dict["instance_centroid"].to(coord.dtype) - coord
        bias_l1_loss = ((bias_pred - bias_gt).abs().sum(-1) * has_instance).sum() / denominator
        pred_dir = bias_pred / (bias_pred.norm(p=2, dim=1, keepdim=True) + 1e-8)
        gt_dir = bias_gt / (bias_gt.norm(p=2, dim=1, keepdim=True) + 1e-8)
        bias_cosine_loss = (-(pred_dir * gt_dir).sum(-1) * has_instance).sum() / denominator
        return dict(loss=seg_loss + bias_l1_loss + bias_cosine_loss, seg_loss=seg_loss, bias_l1_loss=bias_l1_loss,
                    bias_cosine_loss=bias_cosine_loss)

    def proposals(self, coord: torch.Tensor, offset: torch.Tensor, bias_pred: torch.Tensor,
                  logit_pred: torch.Tensor) -> dict:
        """Upstream's proposals from the shifted points (module doc)."""
        n = coord.shape[0]
        center = (coord + bias_pred) / self.voxel_size
        prob = F.softmax(logit_pred, dim=-1)
        segment_pred = prob.argmax(1)
        ignored = segment_pred.new_tensor(self.segment_ignore_index)
        candidate = torch.nonzero(~torch.isin(segment_pred, ignored)).squeeze(1)
        batch = offset2batch(offset.to(coord.device), n)[candidate]
        counts = torch.bincount(batch, minlength=len(offset))
        bounds = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        idx, start_len = ballquery_batch_p(center[candidate], batch, bounds, self.cluster_thresh,
                                           self.cluster_closed_points)
        cluster_idxs, cluster_offsets = bfs_cluster(segment_pred[candidate], idx, start_len, self.cluster_min_points)
        cluster = cluster_idxs[:, 0].long()
        point = candidate[cluster_idxs[:, 1].long()]
        sizes = torch.diff(cluster_offsets.long())
        seed = point[cluster_offsets[:-1].long()]
        kept = sizes > self.cluster_propose_points
        new_id = torch.cumsum(kept.long(), 0) - 1
        in_kept = kept[cluster]
        cluster, point = new_id[cluster[in_kept]], point[in_kept]
        classes = segment_pred[seed[kept]]
        num = int(kept.sum())
        pred_masks = torch.zeros(num, n, dtype=torch.int32, device=coord.device)
        pred_masks[cluster, point] = 1
        instance_pred = torch.full((n,), -1, dtype=torch.long, device=coord.device)
        instance_pred[point] = cluster
        if num:
            total = prob.new_zeros(num).index_add_(0, cluster, prob[point, classes[cluster]])
            pred_scores = (total / sizes[kept].to(prob.dtype)).cpu()
            pred_classes = classes.cpu()
        else:  # upstream's empty outputs
            pred_scores, pred_classes = torch.tensor([]), torch.tensor([])
        return dict(pred_scores=pred_scores, pred_masks=pred_masks.cpu(), pred_classes=pred_classes,
                    instance_pred=instance_pred)
