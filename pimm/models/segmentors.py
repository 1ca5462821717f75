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
from .losses import CriteriaFitLogits, build_criteria
from pimm.utils.config_domains import ask_class
from pimm.utils.domains import Int, MAX_SIZE, Registered, Rule, Seq

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
        num_classes: number of semantic classes. None (upstream's
            ``DefaultSegmentor``, which has no such argument): no head, the
            backbone's output is the logits -- for a backbone that ends in
            its own classifier (``SpUNet-*`` with ``num_classes``,
            ``MinkUNet*``: its ``output_classes``), so that upstream's
            checkpoints (``backbone.*`` only) load strictly.
        criteria: loss configs summed into ``loss`` (default: cross-entropy
            with ``ignore_index=-1``). Class weights go into the loss config,
            e.g. ``dict(type="CrossEntropyLoss", weight=[...])``.

    ``forward(input_dict)`` returns ``{"seg_logits": (N, num_classes)}`` and,
    when the batch holds ``segment``, a scalar ``"loss"``.
    """

    domains = dict(backbone=Registered("model"), num_classes=Int(1, MAX_SIZE) | None,
                   criteria=Seq(Registered("loss")) | None)

    @classmethod
    def output_classes(cls, args: dict) -> int | None:
        """The columns of ``seg_logits``: what an evaluator of this model must score (pimm.evaluation.common)."""
        given = args.get("num_classes")
        return given if given is not None else ask_class(args.get("backbone"), "model", "output_classes")

    domain_rules = (Rule(lambda a: a.num_classes is not None or DefaultSegmentor._headless(vars(a)) is not False,
                         "num_classes", "a number of classes (the backbone outputs features, not class logits)"),
                    CriteriaFitLogits(lambda a: DefaultSegmentor.output_classes(a)))

    @classmethod
    def _headless(cls, args: dict) -> bool | None:
        """Whether the backbone ends in its own classifier (None: its type is
        unknown, which the backbone's own check reports)."""
        backbone = args.get("backbone")
        kind = backbone.get("type") if isinstance(backbone, dict) else None
        if not callable(kind) and MODELS.find(str(kind)) is None:
            return None
        return bool(ask_class(backbone, "model", "output_classes"))

    def __init__(self, backbone: dict, num_classes: int | None = None, criteria: Sequence[dict] | None = None):
        super().__init__()
        if num_classes is not None and int(num_classes) < 1:
            raise ConfigError(f"DefaultSegmentor: num_classes must be >= 1, got {num_classes}")
        self.backbone, width = build_backbone(backbone, "DefaultSegmentor")
        if num_classes is None and not ask_class(backbone, "model", "output_classes"):
            raise ConfigError(f"DefaultSegmentor: num_classes is missing; give it (backbone {backbone.get('type')!r} "
                              "outputs features, and only a backbone with its own classifier, e.g. SpUNet-v1m1 with "
                              "num_classes or a MinkUNet, needs no head)")
        self.num_classes = int(num_classes) if num_classes is not None else width
        self.seg_head = nn.Linear(width, self.num_classes) if num_classes is not None else nn.Identity()
        self.criteria = build_criteria(criteria or [dict(type="CrossEntropyLoss", ignore_index=-1)],
                                       self.num_classes)

    def forward(self, input_dict: dict) -> dict[str, torch.Tensor]:
        seg_logits = self.seg_head(self.backbone(input_dict))
        out = {"seg_logits": seg_logits}
        if "segment" in input_dict:
            out["loss"] = self.criteria(seg_logits, input_dict["segment"].long(), offset=input_dict.get("offset"))
        return out
