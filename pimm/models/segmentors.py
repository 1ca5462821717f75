"""Semantic segmentation model: any point backbone + a linear per-point classifier.

``DefaultSegmentor`` is the model a config names for point-wise semantic
segmentation (``model = dict(type="DefaultSegmentor", backbone=dict(...),
num_classes=5, criteria=[...])``). The backbone is built through ``MODELS``
and must return (N, C) point features and expose ``out_channels``; the losses
come from :mod:`pimm.models.losses`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError

from . import sparse_unet  # noqa: F401  (registers SparseUNet, the default backbone)
from .losses import build_criteria
from pimm.utils.domains import Int, MAX_SIZE, Registered, Seq

__all__ = ["DefaultSegmentor", "build_backbone"]


def build_backbone(cfg: dict, owner: str) -> tuple[nn.Module, int]:
    """Build a backbone config and return it with its feature width."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{owner}: backbone must be a dict(type=...), got {cfg!r}")
    backbone = MODELS.build(cfg)
    width = getattr(backbone, "out_channels", None)
    if not isinstance(width, int):
        raise ConfigError(f"{owner}: backbone {cfg.get('type')!r} does not define an integer out_channels")
    return backbone, width


@MODELS.register_module()
class DefaultSegmentor(nn.Module):
    """Backbone features -> ``Linear`` -> per-point class logits.

    Args:
        backbone: backbone config, built through ``MODELS``.
        num_classes: number of semantic classes.
        criteria: loss configs summed into ``loss`` (default: cross-entropy
            with ``ignore_index=-1``). Class weights go into the loss config,
            e.g. ``dict(type="CrossEntropyLoss", weight=[...])``.

    ``forward(input_dict)`` returns ``{"seg_logits": (N, num_classes)}`` and,
    when the batch holds ``segment``, a scalar ``"loss"``.
    """

    domains = dict(backbone=Registered("model"), num_classes=Int(1, MAX_SIZE),
                   criteria=Seq(Registered("loss")) | None)

    def __init__(self, backbone: dict, num_classes: int, criteria: Sequence[dict] | None = None):
        super().__init__()
        if int(num_classes) < 1:
            raise ConfigError(f"DefaultSegmentor: num_classes must be >= 1, got {num_classes}")
        self.num_classes = int(num_classes)
        self.backbone, width = build_backbone(backbone, "DefaultSegmentor")
        self.seg_head = nn.Linear(width, self.num_classes)
        self.criteria = build_criteria(criteria or [dict(type="CrossEntropyLoss", ignore_index=-1)])

    def forward(self, input_dict: dict) -> dict[str, torch.Tensor]:
        seg_logits = self.seg_head(self.backbone(input_dict))
        out = {"seg_logits": seg_logits}
        if "segment" in input_dict:
            out["loss"] = self.criteria(seg_logits, input_dict["segment"].long(), offset=input_dict.get("offset"))
        return out
