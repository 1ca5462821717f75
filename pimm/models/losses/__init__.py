"""Segmentation losses, looked up by name in the ``LOSSES`` registry.

A model's ``criteria`` is a list of configs such as
``[dict(type="CrossEntropyLoss", ignore_index=-1), dict(type="LovaszLoss", mode="multiclass")]``;
:func:`build_criteria` builds them and sums their (weighted) values.

Every loss takes ``(logits (N, C), target (N,) long)``, drops points whose
target equals ``ignore_index`` and returns a scalar; a loss whose ``forward``
also takes ``offset`` (``LovaszLoss(per_image=True)``) gets the batch's event
offsets. Cross-entropy trains the per-point probabilities, focal loss
down-weights the points already classified well; Lovász-softmax and Dice
optimise surrogates of the per-class overlap, which is what mIoU measures, so
rare classes (Michel, delta rays) weigh as much as the abundant tracks and
showers. Arguments and their meaning (upstream pimm's, where upstream has the
loss): ``docs/models.md``.
"""

from __future__ import annotations

from .base import LOSSES, Criteria, CriteriaFitLogits, build_criteria
from .classification import BinaryFocalLoss, CrossEntropyHeadLoss, CrossEntropyLoss, FocalLoss, SmoothCELoss
from .dice import DiceLoss
from .instance_query import FastInstanceSegmentationLoss, FastInstanceSegmentationRegressionLoss
from .instance_unified import FastUnifiedInstanceLoss
from .lovasz import LovaszLoss, lovasz_grad
from .regression import L1RegressionLoss, MSERegressionLoss, SmoothL1RegressionLoss

__all__ = ["LOSSES", "CrossEntropyLoss", "FocalLoss", "LovaszLoss", "DiceLoss", "Criteria", "CriteriaFitLogits",
           "build_criteria", "lovasz_grad", "SmoothCELoss", "CrossEntropyHeadLoss", "BinaryFocalLoss",
           "L1RegressionLoss", "MSERegressionLoss", "SmoothL1RegressionLoss", "FastInstanceSegmentationLoss",
           "FastInstanceSegmentationRegressionLoss", "FastUnifiedInstanceLoss"]
