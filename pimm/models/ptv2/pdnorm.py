"""Prompt-driven normalisation (PDNorm, from Point Prompt Training, Wu et al.
2023) as PT-v2m3 uses it.

A network trained on several data sets at once keeps one BatchNorm per data
set (``decouple``): the batch's *condition* (its data set's name) picks which
one normalises it, so each keeps its own statistics. ``adaptive`` adds a
modulation from a *context* vector (in Point Prompt Training, a learned
embedding of the data set): ``feat * (1 + scale) + shift`` with ``(shift,
scale)`` a SiLU-Linear of the context. A batch has one condition and one
context (upstream's rule: "one batch one condition").
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pimm.utils.errors import UserError

__all__ = ["PDBatchNorm", "Prompt"]

#: ``(condition, context)`` of a batch: the data set's name (or None where no
#: norm is decoupled) and the (1, context_channels) context (or None).
Prompt = tuple


class PDBatchNorm(nn.Module):
    """BatchNorm of (n, c) rows picked by the prompt's condition (``bns.<i>``,
    one per entry of ``conditions``) or shared (``bn``), then the adaptive
    modulation (``modulation.1``, with ``adaptive``)."""

    def __init__(self, num_features: int, context_channels: int = 256, eps: float = 1e-3, momentum: float = 0.01,
                 conditions: Sequence[str] = ("ScanNet", "S3DIS", "Structured3D"), decouple: bool = True,
                 adaptive: bool = False, affine: bool = True):
        super().__init__()
        self.conditions = tuple(conditions)
        self.decouple, self.adaptive, self.affine = decouple, adaptive, affine
        if decouple:
            self.bns = nn.ModuleList(nn.BatchNorm1d(num_features, eps=eps, momentum=momentum, affine=affine)
                                     for _ in self.conditions)
        else:
            self.bn = nn.BatchNorm1d(num_features, eps=eps, momentum=momentum, affine=affine)
        if adaptive:
            self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(context_channels, 2 * num_features, bias=True))

    def forward(self, feat: torch.Tensor, prompt: Prompt | None = None) -> torch.Tensor:
        condition, context = prompt if prompt is not None else (None, None)
        if self.decouple:
            if condition not in self.conditions:
                raise UserError(f"PDBatchNorm: condition {condition!r} is none of the model's conditions "
                                f"{list(self.conditions)}")
            feat = self.bns[self.conditions.index(condition)](feat)
        else:
            feat = self.bn(feat)
        if self.adaptive:
            if context is None:
                raise UserError("PDBatchNorm: adaptive normalisation needs the batch's 'context'")
            shift, scale = self.modulation(context).chunk(2, dim=1)
            feat = feat * (1.0 + scale) + shift
        return feat
