"""Segmentation losses, looked up by name in the ``LOSSES`` registry.

A model's ``criteria`` is a list of configs such as
``[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss")]``;
:func:`build_criteria` builds them and sums their (weighted) values.

Every loss takes ``(logits (N, C), target (N,) long)``, drops points whose
target equals ``ignore_index`` and returns a scalar. Cross-entropy trains the
per-point probabilities; Lovász-softmax and Dice optimise surrogates of the
per-class overlap, which is what mIoU measures, so rare classes (Michel, delta
rays) weigh as much as the abundant tracks and showers.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pimm.utils.errors import ConfigError
from pimm.utils.registry import Registry
from pimm.utils.domains import Choice, Int, MAX_REAL, MAX_SIZE, NonNeg, Real, Seq, Weight

__all__ = ["LOSSES", "CrossEntropyLoss", "LovaszLoss", "DiceLoss", "Criteria", "build_criteria"]

#: Registry of point-wise losses (``dict(type="LovaszLoss", ...)``).
LOSSES = Registry("loss")


def _valid(logits: torch.Tensor, target: torch.Tensor, ignore_index: int | None):
    if ignore_index is None:
        return logits, target
    keep = target != ignore_index
    return logits[keep], target[keep]


@LOSSES.register_module()
class CrossEntropyLoss(nn.Module):
    """Mean cross-entropy over non-ignored points, with optional class ``weight``
    and ``label_smoothing``."""

    domains = dict(weight=Seq(NonNeg, min_len=1) | None, ignore_index=Int(-1, MAX_SIZE),
                   label_smoothing=Real(0, 1, hi_open=True), loss_weight=Weight)

    def __init__(self, weight: Sequence[float] | None = None, ignore_index: int = -1,
                 label_smoothing: float = 0.0, loss_weight: float = 1.0):
        super().__init__()
        # Not persistent: class weights belong to the config, not the checkpoint.
        self.register_buffer("weight", None if weight is None else torch.tensor(weight, dtype=torch.float),
                             persistent=False)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.loss_weight = loss_weight

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not bool((target != self.ignore_index).any()):
            return logits.sum() * 0.0  # keeps the graph alive for all-ignored batches
        loss = F.cross_entropy(logits, target, weight=self.weight, ignore_index=self.ignore_index,
                               label_smoothing=self.label_smoothing)
        return loss * self.loss_weight


def lovasz_grad(gt_sorted: torch.Tensor) -> torch.Tensor:
    """Gradient of the Lovász extension of the Jaccard loss w.r.t. errors sorted
    in decreasing order (Berman et al. 2018, Alg. 1)."""
    gts = gt_sorted.sum()
    intersection = gts - gt_sorted.cumsum(0)
    union = gts + (1.0 - gt_sorted).cumsum(0)
    jaccard = 1.0 - intersection / union
    if gt_sorted.numel() > 1:
        jaccard[1:] = jaccard[1:] - jaccard[:-1]
    return jaccard


@LOSSES.register_module()
class LovaszLoss(nn.Module):
    """Multi-class Lovász-softmax loss: a convex surrogate of 1 - IoU per class.

    ``classes="present"`` averages over classes present in the target (the usual
    choice: absent classes have an undefined IoU); ``"all"`` over every class.
    """

    domains = dict(classes=Choice("present", "all"), ignore_index=Int(-1, MAX_SIZE), loss_weight=Weight)

    def __init__(self, classes: str = "present", ignore_index: int = -1, loss_weight: float = 1.0):
        super().__init__()
        if classes not in ("present", "all"):
            raise ConfigError(f"LovaszLoss: classes must be 'present' or 'all', got {classes!r}")
        self.classes = classes
        self.ignore_index = ignore_index
        self.loss_weight = loss_weight

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, target = _valid(logits, target, self.ignore_index)
        if target.numel() == 0:
            return logits.sum() * 0.0
        probs = logits.float().softmax(dim=1)
        losses = []
        for c in range(probs.shape[1]):
            fg = (target == c).float()
            if self.classes == "present" and fg.sum() == 0:
                continue
            errors = (fg - probs[:, c]).abs()
            errors_sorted, perm = torch.sort(errors, descending=True)
            losses.append(errors_sorted @ lovasz_grad(fg[perm]))
        if not losses:
            return logits.sum() * 0.0
        return torch.stack(losses).mean() * self.loss_weight


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
            raise ConfigError(f"DiceLoss: classes must be 'present' or 'all', got {classes!r}")
        self.smooth = smooth
        self.classes = classes
        self.ignore_index = ignore_index
        self.loss_weight = loss_weight

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, target = _valid(logits, target, self.ignore_index)
        if target.numel() == 0:
            return logits.sum() * 0.0
        probs = logits.float().softmax(dim=1)
        onehot = F.one_hot(target, probs.shape[1]).float()
        inter = (probs * onehot).sum(0)
        denom = probs.sum(0) + onehot.sum(0)
        dice = (2.0 * inter + self.smooth) / (denom + self.smooth)
        if self.classes == "present":
            dice = dice[onehot.sum(0) > 0]
        return (1.0 - dice.mean()) * self.loss_weight


class Criteria(nn.Module):
    """Sum of several losses built from configs."""

    def __init__(self, cfgs: Sequence[dict] | None):
        super().__init__()
        if not cfgs:
            raise ConfigError("criteria is empty: give at least one loss, e.g. [dict(type='CrossEntropyLoss')]")
        self.losses = nn.ModuleList(LOSSES.build(cfg) for cfg in cfgs)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return sum(loss(logits, target) for loss in self.losses)


def build_criteria(cfgs: Sequence[dict] | None) -> Criteria:
    return Criteria(cfgs)
