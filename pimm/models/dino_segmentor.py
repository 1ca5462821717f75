"""``DINOEnhancedSegmentor``: upstream's segmentor that adds image features to
the point features before its head, under its name, arguments and parameter
names (``seg_head``, ``backbone.*``).

Every event carries, besides its points, a second cloud of feature points:
``dino_coord`` (M, 3), ``dino_feat`` (M, D) and ``dino_offset`` -- in
upstream's data, DINO features of the detector's images back-projected into
3D. **pimm computes no DINO (or other image) features**: a data set must
bring them, as its own keys. Each point takes the features of its nearest
feature point of the same event, matched on ``origin_coord`` (the
coordinates before augmentation, ``origin_offset`` their event bounds: a
``Copy(keys_dict=dict(coord="origin_coord"))`` transform and
``Collect(offset_keys_dict=dict(offset="coord", origin_offset="origin_coord",
dino_offset="dino_coord"))`` keep them), and ``seg_head`` classifies the
concatenation ``[backbone features, DINO features]``:
``backbone_out_channels`` is the width of both together.

The backbone is optional (None: the head sees the DINO features alone).
From a point-batch backbone (PT-v3) the features are a hypercolumn, as
upstream builds it: with ``traceable=True`` each decoder level's features are
concatenated onto the finer level's points down the ``unpooling_parent``
chain, and an encoder-only output is walked up its ``pooling_parent`` chain.
``freeze_backbone`` runs the backbone without gradients (its mode follows
the model's, as upstream's).

Differences from upstream: ``criteria`` defaults to cross-entropy
(``ignore_index=-1``; upstream's default is no loss, which cannot train);
``seg_logits`` is returned in training too (pimm's evaluators read it); a
point whose event has no feature point is a one-line error (upstream's
``torch_cluster.knn`` then leaves the point out and the concatenation fails).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import Int, MAX_SIZE, Registered, Seq, Size
from pimm.utils.errors import ConfigError

from .losses import CriteriaFitLogits, build_criteria
from .segmentor_v2 import DefaultSegmentorV2
from .sonata.matching import match_nearest

__all__ = ["DINOEnhancedSegmentor", "hypercolumn"]

_FEATURE_KEYS = ("dino_coord", "dino_feat", "dino_offset")


def hypercolumn(point) -> tuple[torch.Tensor, object]:
    """Per-point features of a backbone's output, upstream's way: every
    decoder level of a traceable output concatenated onto the finer one's
    points (coarsest first), then an encoder-only output's levels likewise.
    A plain (N, C) tensor is its own features."""
    if isinstance(point, torch.Tensor):
        return point, None
    chain = [point]
    while "unpooling_parent" in chain[-1]:
        chain.append(chain[-1].pop("unpooling_parent"))
    for fine, coarse in reversed(list(zip(chain[:-1], chain[1:]))):
        inverse = fine.pop("unpooling_inverse", None)
        if inverse is None:
            inverse = coarse["pooling_inverse"]
        fine["feat"] = torch.cat([fine["feat"], coarse["feat"].index_select(0, inverse)], dim=-1)
    return DefaultSegmentorV2.point_features(chain[0])


@MODELS.register_module()
class DINOEnhancedSegmentor(nn.Module):
    """Backbone features + nearest DINO features -> head -> ``seg_logits`` (module doc).

    Args:
        num_classes: classes of the head (0: no head, the features are the logits).
        backbone_out_channels: width of the backbone's features plus the DINO features'.
        backbone: backbone config (built through ``MODELS``), or None.
        criteria: loss configs (default: cross-entropy, ``ignore_index=-1``).
        freeze_backbone: no gradients into the backbone.
    """

    domains = dict(num_classes=Int(0, MAX_SIZE), backbone_out_channels=Size, backbone=Registered("model") | None,
                   criteria=Seq(Registered("loss")) | None)
    domain_rules = (CriteriaFitLogits(lambda a: a.get("num_classes") or a.get("backbone_out_channels")),)

    @classmethod
    def output_classes(cls, args: dict) -> int:
        """The columns of ``seg_logits`` (num_classes=0: the features are the logits)."""
        return args.get("num_classes") or args.get("backbone_out_channels")

    def __init__(self, num_classes: int, backbone_out_channels: int, backbone: dict | None = None,
                 criteria: Sequence[dict] | None = None, freeze_backbone: bool = False):
        super().__init__()
        if backbone is not None and not isinstance(backbone, dict):
            raise ConfigError(f"DINOEnhancedSegmentor: backbone must be None or a dict(type=...), got {backbone!r}")
        width, num_classes = int(backbone_out_channels), int(num_classes)
        self.seg_head = nn.Linear(width, num_classes) if num_classes > 0 else nn.Identity()
        self.backbone = MODELS.build(backbone) if backbone is not None else None
        self.criteria = build_criteria(criteria or [dict(type="CrossEntropyLoss", ignore_index=-1)],
                                       num_classes or width)
        self.num_classes, self.width = num_classes, width
        self.freeze_backbone = bool(freeze_backbone)
        if self.backbone is not None and self.freeze_backbone:
            for p in self.backbone.parameters():
                p.requires_grad = False

    def _backbone_features(self, input_dict: dict) -> tuple[list[torch.Tensor], object]:
        if self.backbone is None:
            return [], None
        if self.freeze_backbone:
            with torch.no_grad():
                out = self.backbone(input_dict)
        else:
            out = self.backbone(input_dict)
        feat, point = hypercolumn(out)
        return [feat], point

    def forward(self, input_dict: dict, return_point: bool = False) -> dict[str, torch.Tensor]:
        feats, point = self._backbone_features(input_dict)
        source = point if point is not None and "origin_coord" in point else input_dict
        missing = [k for k in ("origin_coord", "origin_offset") if k not in source]
        missing += [k for k in _FEATURE_KEYS if k not in input_dict]
        if missing:
            raise ConfigError(f"DINOEnhancedSegmentor: the batch lacks {missing}: events must carry DINO features "
                              "(dino_coord, dino_feat; pimm computes none) and origin_coord (Copy coord to it), with "
                              "Collect(offset_keys_dict=dict(offset='coord', origin_offset='origin_coord', "
                              "dino_offset='dino_coord'))")
        origin, origin_offset = source["origin_coord"], source["origin_offset"]
        dino_coord, dino_feat = input_dict["dino_coord"], input_dict["dino_feat"]
        pairs = match_nearest(origin, origin_offset.to(origin.device), dino_coord.to(origin.device),
                              input_dict["dino_offset"].to(origin.device), float("inf"))
        if pairs.shape[0] != origin.shape[0]:
            raise ConfigError(f"DINOEnhancedSegmentor: {origin.shape[0] - pairs.shape[0]} points have no DINO "
                              "feature point in their event (an event with points needs dino_coord entries)")
        nearest = torch.empty_like(pairs[:, 1]).index_copy_(0, pairs[:, 0], pairs[:, 1])
        feat = torch.cat(feats + [dino_feat.to(origin.device).index_select(0, nearest)], dim=-1)
        if feat.shape[1] != self.width:
            raise ConfigError(f"DINOEnhancedSegmentor: backbone_out_channels={self.width} but the backbone and DINO "
                              f"features are {feat.shape[1]} wide together")
        out = {"seg_logits": self.seg_head(feat)}
        if return_point:
            out["point"] = point
        if self.training and "segment" not in input_dict:
            raise ConfigError("DINOEnhancedSegmentor trains on the batch key 'segment'; list it in Collect")
        if "segment" in input_dict:
            out["loss"] = self.criteria(out["seg_logits"], input_dict["segment"].long(),
                                        offset=input_dict.get("offset"))
        return out
