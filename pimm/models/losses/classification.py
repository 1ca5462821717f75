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

__all__ = ["CrossEntropyLoss", "FocalLoss", "SmoothCELoss", "CrossEntropyHeadLoss", "BinaryFocalLoss"]


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


def _check_class_targets(owner: str, target: torch.Tensor, num_classes: int) -> None:
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= num_classes):
        raise ValueError(f"{owner}: targets must be class ids in [0, {num_classes - 1}], got values in "
                         f"[{int(target.min())}, {int(target.max())}] (this loss has no ignore_index: drop those "
                         "points or use CrossEntropyLoss(label_smoothing=...))")


@LOSSES.register_module()
class SmoothCELoss(nn.Module):
    """Cross-entropy against smoothed one-hot targets: the true class gets
    ``1 - smoothing_ratio``, each other class ``smoothing_ratio / (C - 1)``;
    the mean over points of ``-sum_c q_c log p_c``, skipping non-finite rows.

    Upstream's code sums with ``Tensor.total``, which torch does not have (it
    fails on its first call); pimm computes what it means, the sum over
    classes. Every target must be a class id (no ignore_index, as upstream).
    """

    domains = dict(smoothing_ratio=Real(0, 1, hi_open=True))

    def __init__(self, smoothing_ratio: float = 0.1):
        super().__init__()
        if not 0.0 <= float(smoothing_ratio) < 1.0:
            raise ConfigError(f"SmoothCELoss: smoothing_ratio must be in [0, 1), got {smoothing_ratio}")
        self.smoothing_ratio = float(smoothing_ratio)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = _flat_target(target)
        num_classes = logits.shape[1]
        if num_classes < 2:
            raise ValueError("SmoothCELoss: needs at least 2 classes to spread the smoothing over")
        _check_class_targets("SmoothCELoss", target, num_classes)
        eps = self.smoothing_ratio
        onehot = F.one_hot(target, num_classes).to(logits.dtype)
        soft = onehot * (1.0 - eps) + (1.0 - onehot) * (eps / (num_classes - 1))
        per_point = -(soft * F.log_softmax(logits, dim=1)).sum(dim=1)
        finite = per_point[torch.isfinite(per_point)]
        if finite.numel() == 0:
            return zero_loss(logits)
        return finite.mean()


@LOSSES.register_module()
class CrossEntropyHeadLoss(nn.Module):
    """Cross-entropy for an extra categorical head (one row of logits per
    matched query or per event), times ``loss_weight``; targets are cast to
    long. Upstream's defaults: ``ignore_index=-100`` (torch's). A batch whose
    targets are all ignored gives 0 (torch's mean would be nan)."""

    domains = dict(reduction=Choice("mean", "sum", "none"), loss_weight=Weight,
                   label_smoothing=Real(0, 1, hi_open=True), ignore_index=Int(-MAX_SIZE, MAX_SIZE))

    def __init__(self, reduction: str = "mean", loss_weight: float = 1.0, label_smoothing: float = 0.0,
                 ignore_index: int = -100):
        super().__init__()
        self.reduction = legacy_reduction(reduction, None, None)
        if not 0.0 <= float(label_smoothing) < 1.0:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        self.loss_weight = loss_weight
        self.label_smoothing = float(label_smoothing)
        self.ignore_index = int(ignore_index)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = target.long().reshape(-1)
        if self.reduction == "mean" and not bool((target != self.ignore_index).any()):
            return zero_loss(logits)
        return self.loss_weight * F.cross_entropy(logits, target, reduction=self.reduction,
                                                  label_smoothing=self.label_smoothing,
                                                  ignore_index=self.ignore_index)


@LOSSES.register_module()
class BinaryFocalLoss(nn.Module):
    """Focal loss (Lin et al. 2017) for one binary output per element.

    ``bce`` is the per-element binary cross-entropy (of logits when
    ``logits=True``, else of probabilities), ``p_t = exp(-bce)``, and the loss
    ``alpha_t (1 - p_t)^gamma bce`` with ``alpha_t = alpha`` for target 1 and
    ``1 - alpha`` for target 0 (soft targets interpolate). ``reduce=True``:
    the mean; ``False``: per element (not allowed in a model's ``criteria``).
    ``weight``: per-element BCE weights (broadcast against the target).
    """

    domains = dict(gamma=Real(0, 100), alpha=Real(0, 1, lo_open=True, hi_open=True), reduce=Bool,
                   loss_weight=Weight, weight=Seq(NonNeg, min_len=1) | None)

    def __init__(self, gamma: float = 2.0, alpha: float = 0.5, logits: bool = True, reduce: bool = True,
                 loss_weight: float = 1.0, weight: Sequence[float] | None = None):
        super().__init__()
        if not 0.0 < float(alpha) < 1.0:
            raise ConfigError(f"BinaryFocalLoss: alpha must be in (0, 1), got {alpha}")
        if float(gamma) < 0:
            raise ConfigError(f"BinaryFocalLoss: gamma must be >= 0, got {gamma}")
        self.gamma = float(gamma)
        self.alpha = float(alpha)
        self.logits = bool(logits)
        self.reduce = bool(reduce)
        self.loss_weight = loss_weight
        _class_weight_buffer(self, weight)

    @property
    def reduction(self) -> str:
        return "mean" if self.reduce else "none"

    def forward(self, pred: torch.Tensor, target: torch.Tensor, **kwargs) -> torch.Tensor:
        target = target.to(pred.dtype)
        if pred.shape != target.shape and target.dim() == pred.dim() + 1 and target.shape[-1] == 1:
            target = target.squeeze(-1)
        weight = None if self.weight is None else self.weight.to(pred.device, pred.dtype)
        if self.logits:
            bce = F.binary_cross_entropy_with_logits(pred, target, reduction="none", weight=weight)
        else:
            bce = F.binary_cross_entropy(pred, target, reduction="none", weight=weight)
        alpha_t = self.alpha * target + (1.0 - self.alpha) * (1.0 - target)
        loss = alpha_t * (1.0 - torch.exp(-bce)) ** self.gamma * bce
        if self.reduce:
            loss = loss.mean() if loss.numel() else zero_loss(pred)
        return loss * self.loss_weight
