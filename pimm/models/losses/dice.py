"""Soft multi-class Dice loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.utils.domains import Choice, Int, MAX_REAL, MAX_SIZE, Real, Weight
from pimm.utils.errors import ConfigError

from .base import LOSSES, drop_ignored, zero_loss

__all__ = ["DiceLoss"]


@LOSSES.register_module()
class DiceLoss(nn.Module):
    """Soft multi-class Dice loss ``1 - mean_c (2 sum p*y + s) / (sum p + sum y + s)``
    over the classes present in the target (or all with ``classes="all"``)."""

    domains = dict(smooth=Real(0, MAX_REAL), classes=Choice("present", "all"), ignore_index=Int(-1, MAX_SIZE),
                   loss_weight=Weight)

    def __init__(self, smooth: float = 1.0, classes: str = "present", ignore_index: int = -1,
                 loss_weight: float = 1.0):
        super().__init__()
        if classes not in ("present", "all"):
            raise ConfigError(f"classes must be 'present' or 'all', got {classes!r}")
        self.smooth = smooth
        self.classes = classes
        self.ignore_index = ignore_index
        self.loss_weight = loss_weight

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, target = drop_ignored(logits, target, self.ignore_index)
        if target.numel() == 0:
            return zero_loss(logits)
        probs = logits.float().softmax(dim=1)
        onehot = F.one_hot(target, probs.shape[1]).float()
        inter = (probs * onehot).sum(0)
        denom = probs.sum(0) + onehot.sum(0)
        dice = (2.0 * inter + self.smooth) / (denom + self.smooth)
        if self.classes == "present":
            dice = dice[onehot.sum(0) > 0]
        return (1.0 - dice.mean()) * self.loss_weight
