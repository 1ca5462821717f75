"""Regression losses for continuous targets (energies, momenta, vertices),
under upstream pimm's names and arguments.

Each returns ``loss_weight * F.<loss>(pred, target, reduction=...)``; ``pred``
and ``target`` must broadcast. They also serve as the per-head ``criterion``
of the instance regression loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.utils.domains import Choice, MAX_REAL, Real, Weight
from pimm.utils.errors import ConfigError

from .base import LOSSES, REDUCTIONS

__all__ = ["L1RegressionLoss", "MSERegressionLoss", "SmoothL1RegressionLoss"]


def _check_reduction(owner: str, reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ConfigError(f"{owner}: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    return reduction


def _check_shapes(owner: str, pred: torch.Tensor, target: torch.Tensor) -> None:
    try:
        torch.broadcast_shapes(pred.shape, target.shape)
    except RuntimeError:
        raise ValueError(f"{owner}: prediction {tuple(pred.shape)} and target {tuple(target.shape)} do not "
                         "broadcast: the head's output width must match the target's") from None


class _RegressionLoss(nn.Module):
    domains = dict(reduction=Choice(*REDUCTIONS), loss_weight=Weight)

    def __init__(self, reduction: str = "mean", loss_weight: float = 1.0):
        super().__init__()
        self.reduction = _check_reduction(type(self).__name__, reduction)
        self.loss_weight = loss_weight

    def _loss(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_shapes(type(self).__name__, pred, target)
        return self.loss_weight * self._loss(pred, target.to(pred.dtype))


@LOSSES.register_module()
class L1RegressionLoss(_RegressionLoss):
    """Mean absolute error ``|pred - target|`` (reduced), times ``loss_weight``."""

    def _loss(self, pred, target):
        return F.l1_loss(pred, target, reduction=self.reduction)


@LOSSES.register_module()
class MSERegressionLoss(_RegressionLoss):
    """Mean squared error ``(pred - target)^2`` (reduced), times ``loss_weight``."""

    def _loss(self, pred, target):
        return F.mse_loss(pred, target, reduction=self.reduction)


@LOSSES.register_module()
class SmoothL1RegressionLoss(_RegressionLoss):
    """Huber-style smooth L1: quadratic below ``beta``, linear above (reduced),
    times ``loss_weight``. ``beta=0`` is plain L1."""

    domains = dict(beta=Real(0, MAX_REAL))

    def __init__(self, beta: float = 1.0, reduction: str = "mean", loss_weight: float = 1.0):
        super().__init__(reduction=reduction, loss_weight=loss_weight)
        if float(beta) < 0:
            raise ConfigError(f"SmoothL1RegressionLoss: beta must be >= 0, got {beta}")
        self.beta = float(beta)

    def _loss(self, pred, target):
        return F.smooth_l1_loss(pred, target, beta=self.beta, reduction=self.reduction)
