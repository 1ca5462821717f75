"""Soft multi-class Dice loss (V-Net, Milletari et al. 2016), with upstream
pimm's arguments and, by default, upstream's value."""

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
    """``mean_c [1 - (2 sum p_c y_c + smooth) / (sum (p_c^e + y_c^e) + smooth)]``
    over the kept points, ``p`` the softmax of the logits, ``y`` the one-hot
    target and ``e`` the ``exponent``; times ``loss_weight``.

    ``classes="all"`` (upstream's only behaviour, the default): every class
    takes part and the sum is divided by the number of classes; a class whose
    id equals ``ignore_index`` is left out of the sum (still counted in the
    divisor, as upstream). ``classes="present"``: the mean over the classes
    present in the kept targets only.
    """

    domains = dict(smooth=Real(0, MAX_REAL), exponent=Real(0, 16, lo_open=True),
                   classes=Choice("present", "all"), ignore_index=Int(-1, MAX_SIZE), loss_weight=Weight)

    def __init__(self, smooth: float = 1.0, exponent: float = 2.0, loss_weight: float = 1.0,
                 ignore_index: int = -1, classes: str = "all"):
        super().__init__()
        if classes not in ("present", "all"):
            raise ConfigError(f"classes must be 'present' or 'all', got {classes!r}")
        if not float(exponent) > 0:
            raise ConfigError(f"DiceLoss: exponent must be > 0, got {exponent}")
        self.smooth = float(smooth)
        self.exponent = float(exponent)
        self.classes = classes
        self.ignore_index = ignore_index
        self.loss_weight = loss_weight

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.reshape(-1, logits.shape[-1])
        target = target.reshape(-1).long()
        if logits.shape[0] != target.shape[0]:
            raise ValueError(f"DiceLoss: {logits.shape[0]} rows of logits but {target.shape[0]} targets")
        logits, target = drop_ignored(logits, target, self.ignore_index)
        if target.numel() == 0:
            return zero_loss(logits)
        num_classes = logits.shape[1]
        probs = logits.float().softmax(dim=1)
        onehot = F.one_hot(target.clamp(0, num_classes - 1), num_classes).float()
        inter = (probs * onehot).sum(0)
        denom = (probs.pow(self.exponent) + onehot.pow(self.exponent)).sum(0)
        per_class = 1.0 - (2.0 * inter + self.smooth) / (denom + self.smooth)
        if self.classes == "present":
            loss = per_class[onehot.sum(0) > 0].mean()
        else:
            counted = torch.ones(num_classes, dtype=torch.bool, device=per_class.device)
            if 0 <= self.ignore_index < num_classes:
                counted[self.ignore_index] = False
            loss = per_class[counted].sum() / num_classes
        return loss * self.loss_weight
