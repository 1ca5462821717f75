"""Upstream pimm's task wrappers that its tutorials use: a backbone, a head
and the criteria, read from and written to upstream's keys.

* ``DefaultClassifier``: one class per event. Point features are averaged
  per event (by the batch's ``offset``) and classified by upstream's
  two-hidden-layer MLP head; target ``category``, output ``cls_logits``.
* ``DefaultSegmentorV3``: a backbone that predicts the logits itself
  (``point.pred_logits``); target ``segment``, output ``seg_logits``.
* ``DefaultInsSegmentor``: ``DefaultSegmentorV2``'s linear head trained
  against ``query_truth`` (an instance-query target); output ``seg_logits``.

Every wrapper returns ``loss`` when the batch holds its target and always
the logits (upstream leaves them out while training; pimm's train-time hooks
read them); ``return_point=True`` adds the backbone's point batch (``point``)
where upstream offers it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.config_domains import answers_with
from pimm.utils.domains import Int, MAX_SIZE, Registered, Seq, Size
from pimm.utils.errors import ConfigError

from .losses import CriteriaFitLogits, build_criteria
from .point_ops import offset2batch, scatter_mean
from .segmentor_v2 import DefaultSegmentorV2

__all__ = ["DefaultClassifier", "DefaultSegmentorV3", "DefaultInsSegmentor"]


def _build_backbone(owner: str, backbone) -> nn.Module:
    if not isinstance(backbone, dict):
        raise ConfigError(f"{owner}: backbone must be a dict(type=...), got {backbone!r}")
    return MODELS.build(backbone)


def _freeze(module: nn.Module) -> None:
    for p in module.parameters():
        p.requires_grad = False


def _criteria(cfgs, columns: int | None = None):
    return build_criteria(cfgs or [dict(type="CrossEntropyLoss", ignore_index=-1)], columns)


def _loss(criteria, logits, target, offset=None):
    return criteria(logits, target, offset=offset)


@MODELS.register_module()
class DefaultClassifier(nn.Module):
    """Backbone -> per-event mean of the point features -> MLP head ->
    ``cls_logits`` (B, num_classes); ``loss`` against ``category`` (B,).

    The head is upstream's: Linear(backbone_embed_dim, 256)-BN-ReLU-Dropout(0.5)
    -Linear(256, 128)-BN-ReLU-Dropout(0.5)-Linear(128, num_classes). A backbone
    returning one row per event (already pooled) is used as is.
    """

    domains = dict(backbone=Registered("model"), criteria=Seq(Registered("loss")) | None,
                   num_classes=Int(1, MAX_SIZE), backbone_embed_dim=Size)
    output_classes = answers_with("num_classes")  # the columns of cls_logits
    domain_rules = (CriteriaFitLogits(),)

    def __init__(self, backbone: dict | None = None, criteria: Sequence[dict] | None = None, num_classes: int = 40,
                 backbone_embed_dim: int = 256):
        super().__init__()
        self.backbone = _build_backbone("DefaultClassifier", backbone)
        declared = getattr(self.backbone, "out_channels", None)
        if isinstance(declared, int) and declared != int(backbone_embed_dim):
            raise ConfigError(f"DefaultClassifier: backbone_embed_dim={backbone_embed_dim} but the backbone "
                              f"{backbone.get('type')!r} outputs {declared} channels")
        self.criteria = _criteria(criteria, int(num_classes))
        self.num_classes = int(num_classes)
        self.backbone_embed_dim = int(backbone_embed_dim)
        self.cls_head = nn.Sequential(
            nn.Linear(self.backbone_embed_dim, 256), nn.BatchNorm1d(256), nn.ReLU(inplace=True), nn.Dropout(p=0.5),
            nn.Linear(256, 128), nn.BatchNorm1d(128), nn.ReLU(inplace=True), nn.Dropout(p=0.5),
            nn.Linear(128, self.num_classes),
        )

    @staticmethod
    def event_features(output, input_dict: dict) -> torch.Tensor:
        """(B, C) features: the per-event mean of a point batch's ``feat`` (or of
        an (N, C) tensor over the input's ``offset``), or an already pooled (B, C)."""
        offset = input_dict.get("offset")
        if isinstance(output, torch.Tensor):
            feat, point_offset = output, offset
        else:
            feat, point_offset = output["feat"], output.get("offset", offset)
        if point_offset is None:
            raise KeyError("DefaultClassifier: the batch has no 'offset' to pool the point features per event; "
                           "collate with pimm's point_collate_fn")
        point_offset = point_offset.reshape(-1)
        num_events, num_points = point_offset.numel(), int(point_offset[-1]) if point_offset.numel() else 0
        if feat.shape[0] == num_points:
            return scatter_mean(feat, offset2batch(point_offset, feat.shape[0]), num_events)
        if feat.shape[0] == num_events:
            return feat  # the backbone pooled already
        raise ValueError(f"DefaultClassifier: the backbone returned {feat.shape[0]} rows for a batch of "
                         f"{num_events} events and {num_points} points")

    def forward(self, input_dict: dict) -> dict[str, torch.Tensor]:
        feat = self.event_features(self.backbone(input_dict), input_dict)
        cls_logits = self.cls_head(feat)
        if "category" in input_dict:
            return dict(loss=_loss(self.criteria, cls_logits, input_dict["category"].reshape(-1).long()),
                        cls_logits=cls_logits)
        if self.training:
            raise KeyError("DefaultClassifier: a training batch needs 'category' (one class id per event)")
        return dict(cls_logits=cls_logits)


@MODELS.register_module()
class DefaultSegmentorV3(nn.Module):
    """A backbone that predicts the per-point logits itself (it returns a point
    batch holding ``pred_logits``) -> ``seg_logits``; ``loss`` against ``segment``.
    ``freeze_backbone``: no gradients into the backbone, kept in eval mode."""

    domains = dict(backbone=Registered("model"), criteria=Seq(Registered("loss")) | None)

    def __init__(self, backbone: dict | None = None, criteria: Sequence[dict] | None = None,
                 freeze_backbone: bool = False):
        super().__init__()
        self.backbone = _build_backbone("DefaultSegmentorV3", backbone)
        self.criteria = _criteria(criteria)
        self.freeze_backbone = bool(freeze_backbone)
        if self.freeze_backbone:
            _freeze(self.backbone)
            self.backbone.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        if self.freeze_backbone:
            self.backbone.eval()
        return self

    def forward(self, input_dict: dict, return_point: bool = False) -> dict[str, torch.Tensor]:
        point = self.backbone(input_dict)
        if isinstance(point, torch.Tensor) or "pred_logits" not in point:
            raise TypeError(f"DefaultSegmentorV3: the backbone {type(self.backbone).__name__} returns no "
                            "'pred_logits' (it outputs features, not logits): use DefaultSegmentorV2, which adds "
                            "the head")
        out = dict(seg_logits=point["pred_logits"])
        if return_point:
            out["point"] = point
        if "segment" in input_dict:
            out["loss"] = _loss(self.criteria, out["seg_logits"], input_dict["segment"].long(),
                                input_dict.get("offset"))
        return out


@MODELS.register_module()
class DefaultInsSegmentor(DefaultSegmentorV2):
    """``DefaultSegmentorV2``'s backbone and linear head, trained against
    ``query_truth`` instead of ``segment`` (upstream's instance-query
    wrapper). Upstream accepts ``imprint_weights`` and never reads it; so
    does pimm. Unlike ``DefaultSegmentorV2``, a frozen backbone is not held
    in eval mode (upstream's behaviour: its normalisation statistics keep
    updating)."""

    domains = dict(num_classes=Int(0, MAX_SIZE))

    @classmethod
    def output_classes(cls, args: dict) -> None:
        """Its logits score instance queries (``query_truth``), not semantic classes: no class evaluator applies."""
        return None

    def __init__(self, num_classes: int, backbone_out_channels: int, backbone: dict | None = None,
                 criteria: Sequence[dict] | None = None, freeze_backbone: bool = False,
                 imprint_weights: bool = False):
        super().__init__(num_classes=num_classes, backbone_out_channels=backbone_out_channels, backbone=backbone,
                         criteria=criteria, freeze_backbone=False)
        self.freeze_backbone = bool(freeze_backbone)
        self.imprint_weights = bool(imprint_weights)
        if self.freeze_backbone:
            _freeze(self.backbone)

    def forward(self, input_dict: dict, return_point: bool = False) -> dict[str, torch.Tensor]:
        feat, point = self.point_features(self.backbone(input_dict))
        out = {"seg_logits": self.seg_head(feat)}
        if return_point:
            out["point"] = point
        if "query_truth" in input_dict:
            out["loss"] = _loss(self.criteria, out["seg_logits"], input_dict["query_truth"].long(),
                                input_dict.get("offset"))
        elif self.training:
            raise KeyError("DefaultInsSegmentor: a training batch needs 'query_truth'")
        return out
