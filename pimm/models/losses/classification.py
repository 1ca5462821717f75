"""Per-point classification losses: cross-entropy and focal loss, with
upstream pimm's arguments and meaning (see ``docs/models.md``)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pimm.utils.domains import Bool, Choice, Int, MAX_SIZE, NonNeg, Real, Seq, Weight
from pimm.utils.errors import ConfigError

from .base import LOSSES, legacy_reduction, zero_loss

__all__ = ["CrossEntropyLoss", "FocalLoss"]


def _class_weight_buffer(module: nn.Module, weight: Sequence[float] | None) -> None:
    if weight is not None:
        try:
            weight = torch.tensor([float(w) for w in weight], dtype=torch.float)
        except (TypeError, ValueError):
            raise ConfigError(f"weight must be a list of numbers, one per class, got {weight!r}") from None
    # Not persistent: class weights belong to the config, not the checkpoint.
    module.register_buffer("weight", weight, persistent=False)


def _check_weight_width(owner: str, weight: torch.Tensor | None, num_classes: int) -> None:
    if weight is not None and weight.numel() != num_classes:
        raise ConfigError(f"{owner}: weight has {weight.numel()} entries but the model predicts {num_classes} "
                          "classes: give one weight per class")


def _flat_target(target: torch.Tensor) -> torch.Tensor:
    """Upstream accepts targets of shape (N,) or (N, 1)."""
    if target.dim() == 2 and target.shape[-1] == 1:
        target = target.squeeze(-1)
    return target.long()


@LOSSES.register_module()
class CrossEntropyLoss(nn.Module):
    """Cross-entropy over non-ignored points (``torch.nn.CrossEntropyLoss``),
    times ``loss_weight``.

    Args:
        weight: per-class rescaling (one number per class).
        ignore_index: target value that takes no part in the loss.
        label_smoothing: mass spread uniformly over the classes, in [0, 1).
        reduction: ``"mean"`` (weighted mean over kept points), ``"sum"`` or
            ``"none"`` (per point; not allowed inside a model's ``criteria``).
        size_average, reduce: torch's deprecated flags; when given they decide
            ``reduction`` as in torch.
        loss_weight: factor on the result.
    """

    domains = dict(weight=Seq(NonNeg, min_len=1) | None, size_average=Bool | None,
                   reduce=Bool | None, reduction=Choice("mean", "sum", "none"),
                   label_smoothing=Real(0, 1, hi_open=True), loss_weight=Weight, ignore_index=Int(-1, MAX_SIZE))

    def __init__(self, weight: Sequence[float] | None = None, size_average: bool | None = None,
                 reduce: bool | None = None, reduction: str = "mean", label_smoothing: float = 0.0,
                 loss_weight: float = 1.0, ignore_index: int = -1):
        super().__init__()
        _class_weight_buffer(self, weight)
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.reduction = legacy_reduction(reduction, size_average, reduce)
        self.ignore_index = ignore_index
        self.label_smoothing = float(label_smoothing)
        self.loss_weight = loss_weight

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = _flat_target(target)
        _check_weight_width("CrossEntropyLoss", self.weight, logits.shape[-1])
        if self.reduction == "mean" and not bool((target != self.ignore_index).any()):
            return zero_loss(logits)  # torch's mean over no points is nan
        loss = F.cross_entropy(logits, target, weight=self.weight, ignore_index=self.ignore_index,
                               label_smoothing=self.label_smoothing, reduction=self.reduction)
        return loss * self.loss_weight


@LOSSES.register_module()
class FocalLoss(nn.Module):
    """Multi-class focal loss (Lin et al. 2017) with upstream pimm's weighting.

    Per kept point ``i`` with true class ``t``: ``alpha_i (1 - p_t)^gamma
    (-log p_t)``, ``p_t`` the softmax probability of the true class. Without
    ``weight``, ``alpha_i = 1``. With ``weight`` (one number per class) upstream
    indexes it by the point's **predicted** class (``argmax`` of the logits,
    not differentiated) unless ``penalize_pred=True``, which indexes it by the
    **true** class (the paper's alpha_t). ``"mean"`` divides the sum by the
    number of kept points (not by the sum of weights).

    Args:
        weight: per-class weights (see above).
        gamma: focusing exponent, >= 0 (0 with no weight: cross-entropy).
        ignore_index: target value that takes no part in the loss.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per point, 0 at ignored
            points; not allowed inside a model's ``criteria``).
        size_average, reduce: torch's deprecated flags (decide ``reduction``).
        loss_weight: factor on the result.
        penalize_pred: index ``weight`` by the true class instead of the
            predicted one (upstream's name for it).
    """

    domains = dict(weight=Seq(NonNeg, min_len=1) | None, size_average=Bool | None,
                   reduce=Bool | None, reduction=Choice("mean", "sum", "none"),
                   gamma=Real(0, 100), ignore_index=Int(-1, MAX_SIZE), loss_weight=Weight)

    def __init__(self, weight: Sequence[float] | None = None, size_average: bool | None = None,
                 reduce: bool | None = None, reduction: str = "mean", gamma: float = 2.0, ignore_index: int = -1,
                 loss_weight: float = 1.0, penalize_pred: bool = False):
        super().__init__()
        _class_weight_buffer(self, weight)
        if float(gamma) < 0:
            raise ConfigError(f"gamma must be >= 0, got {gamma}")
        self.reduction = legacy_reduction(reduction, size_average, reduce)
        self.gamma = float(gamma)
        self.ignore_index = ignore_index
        self.loss_weight = loss_weight
        self.penalize_pred = bool(penalize_pred)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.reshape(-1, logits.shape[-1])
        target = target.reshape(-1).long()
        _check_weight_width("FocalLoss", self.weight, logits.shape[-1])
        keep = target != self.ignore_index
        safe_target = torch.where(keep, target, torch.zeros_like(target))
        log_p_t = F.log_softmax(logits.float(), dim=-1).gather(1, safe_target[:, None])[:, 0]
        loss = (1.0 - log_p_t.exp()).pow(self.gamma) * -log_p_t
        if self.weight is not None:
            by = safe_target if self.penalize_pred else logits.detach().argmax(dim=-1)
            loss = loss * self.weight[by]
        loss = torch.where(keep, loss, torch.zeros_like(loss))
        if self.reduction == "none":
            return loss * self.loss_weight
        if not bool(keep.any()):
            return zero_loss(logits)
        total = loss.sum()
        if self.reduction == "mean":
            total = total / keep.sum()
        return total * self.loss_weight
