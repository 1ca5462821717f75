"""``DefaultSegmentorV2``: upstream's segmentor for backbones that return a
point batch (PT-v3, Sonata fine-tuning).

``model = dict(type="DefaultSegmentorV2", num_classes=5,
backbone_out_channels=64, backbone=dict(type="PT-v3m2", ...), criteria=[...])``.
The backbone's output is walked back up its ``pooling_parent`` chain (an
encoder-only backbone: every level's features concatenated onto its
children), and a linear head (or upstream's small MLP head with
``mlp_head=True``) classifies every input point. ``freeze_backbone`` keeps the
backbone fixed and in eval mode (linear probing). A backbone returning a
plain (N, C) tensor works as well.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError

from .losses import CriteriaFitLogits, build_criteria
from pimm.utils.domains import Int, MAX_SIZE, Registered, Rule, Seq, Size

__all__ = ["DefaultSegmentorV2"]


@MODELS.register_module()
class DefaultSegmentorV2(nn.Module):
    """Backbone -> point features -> head -> ``seg_logits`` (N, num_classes),
    plus ``loss`` when the batch holds ``segment``.

    Args:
        num_classes: classes of the head (0: no head, the features are the logits).
        backbone_out_channels: width of the backbone's output features (checked
            against the backbone's ``out_channels`` when it declares one).
        backbone: backbone config (built through ``MODELS``).
        criteria: loss configs (default: cross-entropy, ``ignore_index=-1``).
        freeze_backbone: no gradients into the backbone, which stays in eval mode.
        mlp_head: Linear-ReLU-Dropout-Linear head instead of one Linear.
    """

    domains = dict(num_classes=Int(0, MAX_SIZE), backbone_out_channels=Size, backbone=Registered("model") | None,
                   criteria=Seq(Registered("loss")) | None)
    domain_rules = (Rule(lambda a: a.num_classes > 0 or not a.mlp_head, "num_classes",
                         "a positive number of classes with mlp_head=True (0, no head, needs mlp_head=False)"),
                    CriteriaFitLogits(lambda a: a.get("num_classes") or a.get("backbone_out_channels")))

    @classmethod
    def output_classes(cls, args: dict) -> int:
        """The columns of ``seg_logits``: what an evaluator of this model must
        score (num_classes=0: the backbone's features are the logits)."""
        return args.get("num_classes") or args.get("backbone_out_channels")

    def __init__(self, num_classes: int, backbone_out_channels: int, backbone: dict | None = None,
                 criteria: Sequence[dict] | None = None, freeze_backbone: bool = False, mlp_head: bool = False):
        super().__init__()
        if not isinstance(backbone, dict):
            raise ConfigError(f"DefaultSegmentorV2: backbone must be a dict(type=...), got {backbone!r}")
        if int(num_classes) < 0 or (mlp_head and int(num_classes) == 0):
            raise ConfigError(f"DefaultSegmentorV2: num_classes={num_classes} is invalid: it takes a number of classes "
                              ">= 1, or 0 (no head: the features are the logits) with mlp_head=False")
        width = int(backbone_out_channels)
        if mlp_head:
            self.seg_head = nn.Sequential(nn.Linear(width, width // 2), nn.ReLU(inplace=True), nn.Dropout(p=0.3),
                                          nn.Linear(width // 2, num_classes))
        else:
            self.seg_head = nn.Linear(width, num_classes) if num_classes > 0 else nn.Identity()
        self.backbone = MODELS.build(backbone)
        declared = getattr(self.backbone, "out_channels", None)
        if isinstance(declared, int) and declared != width:
            raise ConfigError(f"DefaultSegmentorV2: backbone_out_channels={width} but the backbone "
                              f"{backbone.get('type')!r} outputs {declared} channels")
        self.num_classes = int(num_classes)
        self.criteria = build_criteria(criteria or [dict(type="CrossEntropyLoss", ignore_index=-1)],
                                       int(num_classes) or width)
        self.freeze_backbone = bool(freeze_backbone)
        if self.freeze_backbone:
            for p in self.backbone.parameters():
                p.requires_grad = False
            self.backbone.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.freeze_backbone:  # the trainer calls train() every epoch
            self.backbone.eval()
        return self

    @staticmethod
    def point_features(point) -> tuple[torch.Tensor, object]:
        """Features of the finest level: an encoder-only output is un-pooled by
        concatenating each level's features onto its children."""
        if isinstance(point, torch.Tensor):
            return point, None
        while "pooling_parent" in point:
            parent = point.pop("pooling_parent")
            inverse = point.pop("pooling_inverse")
            parent["feat"] = torch.cat([parent["feat"], point["feat"].index_select(0, inverse)], dim=-1)
            point = parent
        return point["feat"], point

    def forward(self, input_dict: dict, return_point: bool = False) -> dict[str, torch.Tensor]:
        feat, point = self.point_features(self.backbone(input_dict))
        out = {"seg_logits": self.seg_head(feat)}
        if return_point:
            out["point"] = point
        if "segment" in input_dict:
            out["loss"] = self.criteria(out["seg_logits"], input_dict["segment"].long(),
                                        offset=input_dict.get("offset"))
        return out
